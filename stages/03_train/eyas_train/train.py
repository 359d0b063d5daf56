"""`eyas-train run`: hidden dataset -> trained EAGLE-3 draft in drafts/NAME (resumable, torchrun-aware).

drafts/NAME/ and its files are described in eyas_common.drafts, the format's owner.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.checkpoint import read_text_config
from eyas_common.contract import (REMAKE, Dataset, DatasetError, JsonlAppender, await_start, check_target, finalize,
                                  input_ref, iter_jsonl, new_manifest, open_input, open_output, remake_fix,
                                  write_jsonl_atomic)
from eyas_common.drafts import (BEST_FILE, CKPT_DIR, LOG_FILE, PLOT_FILE, checkpoint_name, checkpoint_paths,
                                read_checkpoint, readable_checkpoint, target_mismatch, write_checkpoint)
from eyas_common.hidden import HiddenShards, consume, consuming, shard_name, size_text
from eyas_common.launch import INTERRUPTED
from eyas_common.lock import WriterLock
from eyas_common.model_card import write_model_card
from eyas_common.procs import sigterm_as_interrupt
from eyas_train import parallel
from eyas_train.config import MAY_CHANGE, TrainConfig
from eyas_train.data import global_batches, per_sample, prefetch, rank_share, refuse_no_targets, token_counts
from eyas_train.export import write_draft
from eyas_train.hostmem import HeapTrimmer
from eyas_train.init_draft import check_fits, init_vocab, load_into, read_init_draft, run_config
from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.plot import plot_log
from eyas_train.recipe import (Recipe, predicted_acceptance, replay_acceptance, resolve, split_by_sample,
                               val_count)
from eyas_train.stream import (Consumption, deadlock_error, expected_samples, extract_blocked,
                               first_window, largest_shard, stream_batches, wait_for_shards)
from eyas_train.state import RunState, optimiser, resumed, rng_state
from eyas_train.target import Teacher, attention_shape, check_model, load_embedding, load_lm_head, load_weight
from eyas_train.ttt import UnrolledLoss, step_counts
from eyas_train.vocab import VocabMap, build_vocab

PREDICT_SPEC_TOKENS = 3  # the acceptance length printed at the end is predicted for this many draft tokens


def say(msg: str) -> None:
    """A progress line on stderr that does not break the progress bar."""
    tqdm.write(f"[eyas-train] {msg}", file=sys.stderr)


def draft_config(target: dict[str, Any], hidden_size: int, vocab_size: int, n_aux: int, draft_vocab: int,
                 norm_before_residual: bool) -> DraftConfig:
    """The draft's shape from the target's config: same width, heads and FFN as one target layer."""
    heads, head_dim, rope = attention_shape(target, hidden_size)
    return DraftConfig(
        vocab_size=vocab_size,
        draft_vocab_size=draft_vocab,
        hidden_size=hidden_size,
        target_hidden_size=hidden_size,
        num_aux=n_aux,
        num_attention_heads=heads,
        num_key_value_heads=target.get("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=target["intermediate_size"],
        rms_norm_eps=target.get("rms_norm_eps", 1e-6),
        max_position_embeddings=target.get("max_position_embeddings", 4096),
        rope_parameters=rope,
        norm_before_residual=norm_before_residual,
    )


# ------------------------------------------------------------------------------------------------
# checkpoints


def checkpoints(folder: Path) -> list[Path]:
    return checkpoint_paths(folder)


def save_checkpoint(folder: Path, payload: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint (atomically: eyas_common.drafts), then drop all but the newest `keep`."""
    path = write_checkpoint(folder / CKPT_DIR / checkpoint_name(payload["step"]), payload)
    for old in checkpoints(folder)[:-keep]:
        old.unlink()
    return path


def resume_checkpoint(out: Dataset) -> dict[str, Any] | None:
    """The newest checkpoint of a partial draft (None: none yet, or the draft is complete). An unreadable one
    is refused, naming the checkpoint the rerun would resume from once it is deleted."""
    found = checkpoints(out.path) if out.exists() and out.read_manifest().get("status") != "complete" else []
    if not found:
        return None
    try:
        return read_checkpoint(found[-1])
    except DatasetError as e:
        good = readable_checkpoint(found[:-1])
        fix = (f"delete it and rerun the same command to resume from {good.name}, the newest readable one" if good
               else f"no checkpoint in {found[-1].parent} is readable: delete that folder and rerun the same command "
                    f"to start over")
        raise DatasetError(f"{e.message}; {fix}") from None


def vocab_from(state: dict[str, Any]) -> VocabMap:
    return VocabMap(state["d2t"], state["t2d"], state["coverage"], state["distinct"])


# ------------------------------------------------------------------------------------------------
# the run


def run(*, hidden: str, model: str | Path, name: str, data_root: Path | None = None, **options: Any) -> Path:
    """Train drafts/NAME from hidden/HIDDEN for the target at MODEL; resume it if it was interrupted.

    `options` are TrainConfig fields. Under torchrun every process calls this; otherwise one process
    trains alone. Returns the draft folder.
    """
    allow_code_change = options.pop("allow_code_change", False)
    if options.get("follow"):
        if options.get("order") == "random":
            raise ValueError("--follow trains in shard order: drop --order random (or --follow)")
        options["order"] = "shards"
    cfg = TrainConfig(hidden=hidden, model=str(model), name=name, **options)
    out = Dataset.parse(name, "drafts", data_root)
    d = parallel.init()
    try:
        # One writer per draft (rank 0 writes for all ranks); SIGTERM stops like Ctrl-C, at the last checkpoint.
        consumed = Dataset.parse(hidden, "hidden", data_root) if cfg.consume and d.main else None
        with sigterm_as_interrupt(), WriterLock(out, stage="03_train") if d.main else nullcontext(), \
                consuming(consumed, by=out.ref) if consumed else nullcontext():  # extract's --disk-budget reads it
            return _run(cfg, d, data_root, allow_code_change)
    except KeyboardInterrupt:
        kept = checkpoints(out.path)
        say(f"interrupted: {out.ref} keeps {kept[-1].name if kept else 'no checkpoint yet'}; "
            f"rerun the same command to resume")
        raise SystemExit(INTERRUPTED) from None
    except torch.OutOfMemoryError as e:  # the accelerator's memory: one line (it was a traceback), and what fits
        kept = checkpoints(out.path)
        raise DatasetError(f"out of {d.device} memory ({str(e).split('.')[0]}); {out.ref} keeps "
                           f"{kept[-1].name if kept else 'no checkpoint yet'}, but a resume keeps the batch: start a "
                           f"new --name with a smaller --batch-size (or --batch-tokens) or --max-len, or spread it "
                           f"over more GPUs (torchrun --nproc-per-node N, --parallel fsdp)") from None
    except RuntimeError as e:
        if not parallel.peer_lost(e, d):
            raise
        kept = checkpoints(out.path)
        why = re.sub(r"^\[[^\]]*\]\s*", "", str(e)).split(". ")[0]  # gloo's "[file.cc:553] Connection closed..."
        say(f"rank {d.rank} of {d.world} stopped: another process of this run is gone ({why[:120]}); "
            f"its host was stopped or crashed: look at its log. {out.ref} keeps "
            f"{kept[-1].name if kept else 'no checkpoint yet'}; rerun the same command on every host to resume")
        raise SystemExit(1) from None
    finally:
        parallel.shutdown(d)


def _open(cfg: TrainConfig, data_root: Path | None, allow_code_change: bool):
    """The input (checked against the target loaded now), the output's manifest and its newest checkpoint.

    A complete draft is refused; a partial one resumes from its newest checkpoint, refused when that was
    made with other settings (all but MAY_CHANGE); one with no checkpoint yet starts over. Writes nothing.
    """
    if cfg.follow:
        await_start(cfg.hidden, "hidden", root=data_root, poll_s=cfg.poll_seconds, say=say)
    hidden_ds, hidden_m = open_input(cfg.hidden, "hidden", root=data_root, allow_partial=cfg.follow)
    if cfg.order == "shards" and cfg.method != "eagle3":
        raise ValueError(f"--order shards (and --follow) train EAGLE-3 drafts only for now, not --method {cfg.method}")
    fingerprint = target_fingerprint(load_tokenizer(cfg.model, cfg.trust_remote_code), cfg.model)
    check_target(hidden_ds, hidden_m, fingerprint)
    _check_params(hidden_ds, hidden_m)
    check_model(cfg.model, hidden_ds.ref, hidden_m["params"])
    out = Dataset.parse(cfg.name, "drafts", data_root)
    ckpt = resume_checkpoint(out)
    was = ckpt and ckpt["config"].get("model")
    moved = (f" (the target is no longer at {was}: link it there, `ln -s {Path(cfg.model).absolute()} {was}`)"
             if was and was != cfg.model and not Path(was).exists() else "")
    manifest = open_output(out, stage="03_train", params=cfg.to_dict(), may_change=MAY_CHANGE, target=fingerprint,
                           inputs=_resume_inputs(cfg, out, hidden_ds, hidden_m), allow_code_change=allow_code_change,
                           resume=ckpt is not None, made_with=TrainConfig.as_saved(ckpt["config"]) if ckpt else None,
                           fix=f"rerun with the same settings{moved} to resume from its checkpoint at step "
                               f"{ckpt and ckpt['step']}, or delete it with `eyas-data rm {out.ref}`")
    return hidden_ds, hidden_m, manifest, out, ckpt


def _check_params(hidden_ds: Dataset, hidden_m: dict[str, Any]) -> None:
    """The hidden manifest's params that training reads (a hand-edited manifest may lack them)."""
    params = hidden_m.get("params")
    missing = ["params"] if not isinstance(params, dict) else [f"params.{k}" for k, ok in (
        ("hidden_size", isinstance(params.get("hidden_size"), int)),
        ("layers", isinstance(params.get("layers"), list) and all(isinstance(i, int) for i in params["layers"])))
        if not ok]
    if missing:
        raise DatasetError(f"{hidden_ds.ref}: {hidden_ds.manifest_path} has no valid {', '.join(missing)}: it was "
                           f"edited; {remake_fix(hidden_ds)}")


def _resume_inputs(cfg: TrainConfig, out: Dataset, hidden_ds: Dataset, hidden_m: dict[str, Any]
                   ) -> list[dict[str, str]]:
    """The inputs to resume against. In shard order the hidden dataset may have grown (or completed) since the
    run began, so a partial draft begun from the same hidden dataset keeps its recorded inputs (each shard
    is checked against the manifest's entry as it is read); `_finish` records the inputs as they end."""
    current = _lineage(hidden_ds, hidden_m)
    stored = out.read_manifest() if cfg.order == "shards" and out.manifest_path.exists() else {}
    inputs = stored.get("inputs") or []
    if stored.get("status") != "complete" and inputs[:1] and inputs[0].get("ref") == hidden_ds.ref:
        return inputs
    return current


def _lineage(hidden_ds: Dataset, hidden_m: dict[str, Any]) -> list[dict[str, str]]:
    # The hidden dataset itself, then what it was made from (the synth dataset), so the draft traces to both.
    return [input_ref(hidden_ds)] + [i for i in hidden_m.get("inputs", []) if isinstance(i, dict)]


def _run(cfg: TrainConfig, d: parallel.Dist, data_root: Path | None, allow_code_change: bool = False) -> Path:
    t_start = time.monotonic()
    hidden_ds, hidden_m, manifest, out, ckpt = _open(cfg, data_root, allow_code_change)
    s = _setup(cfg, d, hidden_ds, hidden_m, out, ckpt, data_root)
    run_params = {"config": cfg.to_dict(), "recipe": s.recipe.to_dict(), "draft": s.dcfg.__dict__,
                  "aux_layers": s.aux_layers, "world": d.world, "teacher": s.shards.teacher,
                  "precision": parallel.resolve_precision(cfg.precision, d.device),
                  "steps_per_epoch": s.recipe.steps_per_epoch, "total_steps": s.recipe.total_steps}
    if d.main:
        _prepare_folder(out, manifest | {"params": run_params}, s.start)
        r = s.recipe
        say(f"{r.train_samples} training samples (+{r.val_samples} held out for validation), {r.tokens_per_sample:.0f} "
            f"tokens each: batch {r.batch_size} ({cfg.batching}), {r.steps_per_epoch} steps/epoch x {r.epochs:g} "
            f"epochs = {r.total_steps} steps, peak lr {r.lr:.2g}, warm-up {r.warmup_steps} steps, on {d.world} "
            f"process(es), {d.device} in {run_params['precision']}; draft vocab {s.vocab.d2t.numel()} of "
            f"{s.dcfg.vocab_size} covers {s.vocab.coverage:.2%} of masked tokens ({s.vocab.distinct} distinct"
            + (f"; its other {s.vocab.d2t.numel() - s.vocab.distinct} are the lowest unseen ids: in a BPE "
               f"vocabulary, its earliest merges)" if s.vocab.d2t.numel() > s.vocab.distinct else ")")
            + (f"; resuming at step {s.start}" if s.start else ""))
    parallel.barrier(d)
    _train(s)
    _finish(s, t_start)
    if s.consumption and d.main:
        # Every shard listed is past its last use now, the validation shards too, and so are those a run that
        # ended before the data (an early stop, a shorter schedule) never reached: the dataset serves it alone.
        if not s.shards.complete:
            s.shards.grow()
        _consume(s, sorted(set(range(len(s.shards.files))) - s.consumption.done))
    parallel.barrier(d)
    return out.path


def _setup(cfg: TrainConfig, d: parallel.Dist, hidden_ds: Dataset, hidden_m: dict[str, Any], out: Dataset,
           ckpt: dict[str, Any] | None, data_root: Path | None) -> RunState:
    """Read the hidden dataset, resolve the recipe, build the draft and its optimiser, resume `ckpt`."""
    if cfg.method == "dflash":
        from eyas_train.dflash_train import setup_dflash

        return setup_dflash(cfg, d, hidden_ds, hidden_m, out, ckpt)
    params = hidden_m["params"]
    target = read_text_config(cfg.model)
    hidden_size, aux_layers = int(params["hidden_size"]), list(params["layers"])
    vocab_size = int(params.get("vocab_size") or target["vocab_size"])
    # the manifest's files, sizes checked; shards this draft consumed are counted, not read
    shards = HiddenShards(hidden_ds, hidden_m, follow=cfg.follow, consumer=out.ref)
    if cfg.batch_size is not None and cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} is not a multiple of the {d.world} processes")
    try:
        train_idx, val_idx, recipe, vocab_shards = _split(cfg, d, shards, hidden_m, hidden_size, ckpt)
    except ValueError as e:
        raise DatasetError(f"{hidden_ds.ref}: {e}") from None
    width = shards.read(shards.samples[0], 1)["aux"].shape[-1]
    if width != len(aux_layers) * hidden_size:
        raise DatasetError(f"{hidden_ds.ref}: aux rows are {width} wide, but the manifest says {len(aux_layers)} "
                           f"layers of {hidden_size}; rerun {REMAKE['hidden']}")
    lengths = [min(x.length, cfg.max_len) for x in shards.samples]
    if ckpt is None:  # checked when the run began (a resumed one has the same --max-len; its shards may be consumed)
        refuse_no_targets(hidden_ds, shards, cfg.max_len)

    # A resumed run takes the init draft's weights and vocabulary from its checkpoint and its shape from the draft's
    # manifest: the init draft is read once, so that moving or deleting it later does not block the resume.
    resumed_shape = (out.read_manifest().get("params") or {}).get("draft") if ckpt and cfg.init_draft else None
    init = read_init_draft(cfg.init_draft, data_root) if cfg.init_draft and not resumed_shape else None
    vocab, dcfg = _vocab_and_config(cfg, d, ckpt, init, shards, vocab_shards, target, hidden_size, vocab_size,
                                    aux_layers)
    if resumed_shape:
        dcfg = DraftConfig(**resumed_shape)
    draft, lm_head = _new_draft(cfg, dcfg, vocab)
    if init is not None:
        load_into(draft, init, vocab)  # a resumed run then loads its checkpoint over it
    teacher = Teacher(vocab, lm_head if shards.teacher == "final" else None, d.device)
    loss = UnrolledLoss(draft, cfg.ttt_steps, cfg.step_decay, negatives=cfg.head_negatives)
    module = parallel.wrap(loss.to(d.device), d, cfg.parallel)
    opt, sched = optimiser(cfg, module, recipe)
    s = RunState(cfg, d, out, shards, recipe, train_idx, val_idx, lengths, vocab, dcfg, aux_layers, target, teacher,
                 module, opt, sched)
    if cfg.consume:
        s.consumption = Consumption(shards, val_idx)
    return resumed(s, ckpt)


def _split(cfg: TrainConfig, d: parallel.Dist, shards: HiddenShards, hidden_m: dict[str, Any], hidden_size: int,
           ckpt: dict[str, Any] | None) -> tuple[list[int], list[int], Recipe, int | None]:
    """(training indices, validation indices, recipe, shards the vocabulary is counted over: None for all).
    Random order: from the whole dataset. Shard order: from the first window alone (stream.py), the
    training indices those of the first window (the plan takes the rest as they come)."""
    if cfg.order == "random":
        lengths = [min(x.length, cfg.max_len) for x in shards.samples]
        n_val = val_count(len(shards), cfg.val_samples, d.world)
        train_idx, val_idx = split_by_sample([x.sample_id for x in shards.samples], n_val, cfg.seed)
        return train_idx, val_idx, resolve(cfg, lengths=[lengths[i] for i in train_idx], n_val=n_val,
                                           width=hidden_size, world=d.world), None
    expected = (ckpt or {}).get("expected_samples") or expected_samples(shards.ds, hidden_m)
    n_val = val_count(expected, cfg.val_samples, d.world)
    n_shards = wait_for_shards(shards, cfg.window_shards, poll_s=cfg.poll_seconds, say=say if d.main else _quiet,
                               stuck=(lambda _: _refuse_first_window_deadlock(shards, cfg)) if cfg.consume else None)
    window = first_window(shards, n_shards, n_val)
    if ckpt and "val_ids" in ckpt:  # a resumed run: the window's shards may be consumed (counted, not read)
        val_ids = set(ckpt["val_ids"])
        val_idx = [i for i in window if shards.samples[i].sample_id in val_ids]
        return [i for i in window if i not in set(val_idx)], val_idx, Recipe(**ckpt["recipe"]), n_shards
    local, val_local = split_by_sample([shards.samples[i].sample_id for i in window], n_val, cfg.seed)
    train_idx, val_idx = [window[i] for i in local], [window[i] for i in val_local]
    recipe = resolve(cfg, lengths=[min(shards.samples[i].length, cfg.max_len) for i in train_idx], n_val=n_val,
                     width=hidden_size, world=d.world, n=expected - n_val)
    return train_idx, val_idx, recipe, n_shards


def _quiet(_: str) -> None:
    pass


def _vocab_and_config(cfg: TrainConfig, d: parallel.Dist, ckpt: dict[str, Any] | None, init: Any,
                      shards: HiddenShards, vocab_shards: int | None, target: dict[str, Any], hidden_size: int,
                      vocab_size: int, aux_layers: list[int]) -> tuple[VocabMap, DraftConfig]:
    """The draft vocabulary (a checkpoint's, --init-draft's, or the data's most frequent tokens) and shape."""
    if init is not None:
        check_fits(init, vocab_size=vocab_size, hidden_size=hidden_size, aux_layers=aux_layers)
    if ckpt is not None:
        vocab = vocab_from(ckpt["vocab"])
    elif init is not None:
        vocab, report = init_vocab(init, token_counts(shards, vocab_size, vocab_shards), cfg.init_vocab,
                                   cfg.draft_vocab)
        if d.main:
            say(f"--init-draft {init.source} ({init.layout} layout): {report}")
    else:
        vocab = build_vocab(token_counts(shards, vocab_size, vocab_shards), cfg.draft_vocab)
    if init is not None:
        return vocab, run_config(init, vocab)
    return vocab, draft_config(target, hidden_size, vocab_size, len(aux_layers), vocab.d2t.numel(),
                               cfg.norm_before_residual)


def _new_draft(cfg: TrainConfig, dcfg: DraftConfig, vocab: VocabMap) -> tuple[Eagle3Draft, torch.Tensor]:
    """A seeded draft with the target's embedding, and its final norm and lm_head rows as the output end
    (the layer then only has to produce a state like the target's last residual stream)."""
    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    draft.init_weights(cfg.seed)
    lm_head = load_lm_head(cfg.model)
    with torch.no_grad():
        draft.embed.weight.copy_(load_embedding(cfg.model))
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
        draft.norm.weight.copy_(load_weight(cfg.model, "model.norm.weight"))
        draft.lm_head.weight.copy_(lm_head[vocab.draft_to_target])
    return draft, lm_head


def _plan(s: RunState) -> Iterator[list[int] | None]:
    """This rank's samples for every remaining step (None: a wait for shards follows, see stream.py)."""
    if s.cfg.order == "random":
        r = s.recipe
        for step in range(s.start, r.total_steps):
            epoch, b = divmod(step, r.steps_per_epoch)
            batch = global_batches(r.train_samples, r.batch_size, s.cfg.seed, epoch)[b]
            yield rank_share([s.train_idx[i] for i in batch], s.lengths, s.d.rank, s.d.world)
        return
    step = 0
    for batch in _shard_order(s):
        if batch is None:  # a wait for shards follows
            yield None
            continue
        if step >= s.start:
            s.lengths += [min(x.length, s.cfg.max_len) for x in s.shards.samples[len(s.lengths):]]
            yield rank_share(batch, s.lengths, s.d.rank, s.d.world)
        step += 1


def _shard_order(s: RunState) -> Iterator[list[int] | None]:
    """Every step's global batch in shard order: the streamed first pass (stream.py), then seeded epochs
    over the whole dataset until the recipe's steps are done."""
    r, cfg, val = s.recipe, s.cfg, set(s.val_idx)

    def wait(upto: int) -> int:
        return wait_for_shards(s.shards, upto, poll_s=cfg.poll_seconds, say=say if s.d.main else _quiet,
                               stuck=lambda upto: _refuse_budget_deadlock(s, upto))

    step = 0
    for item in stream_batches(s.shards, window=cfg.window_shards, val=val, batch_size=r.batch_size,
                               seed=cfg.seed, wait=wait):
        if item is None:
            yield None
            continue
        batch, taken, carried = item
        if s.consumption:
            s.consumption.dealt_batch(step, batch, taken, carried)
        yield batch
        step += 1
        if step == r.total_steps:
            return
    if s.consumption:
        s.consumption.all_dealt()
    if r.total_steps <= r.steps_per_epoch:  # a one-pass recipe: the run ends with the data
        return
    s.train_idx = [i for i in range(len(s.shards)) if i not in val]
    for epoch in itertools.count(1):
        batches = global_batches(len(s.train_idx), r.batch_size, cfg.seed, epoch)
        if not batches:
            raise DatasetError(f"{s.shards.ds.ref}: {len(s.train_idx)} training samples are fewer than one batch "
                               f"of {r.batch_size}: lower --batch-size (or --val-samples)")
        for batch in batches:
            yield [s.train_idx[i] for i in batch]
            step += 1
            if step == r.total_steps:
                return


def _forward(s: RunState, batch: dict[str, torch.Tensor], leads: list[torch.Tensor] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The unrolled loss of one global batch (this rank's share) and its per-step stats [steps, 3]
    (`leads`: see UnrolledLoss)."""
    batch = {k: v.to(s.d.device, non_blocking=True) for k, v in batch.items()}
    target_p, target_top = s.teacher(batch)
    mask = batch["loss_mask"]
    denom = parallel.all_sum(step_counts(mask, s.cfg.ttt_steps, batch["segment"]), s.d)
    with parallel.autocast(s.cfg.precision, s.d.device):
        return s.module(batch["input_ids"], batch["aux"].float(), target_p, target_top, mask, denom,
                        positions=batch["positions"], segment=batch["segment"], leads=leads)


def _train(s: RunState) -> None:
    """The optimiser loop: log, validate (and stop early) and checkpoint on their schedules."""
    cfg, d, total = s.cfg, s.d, s.recipe.total_steps
    slots, decay = (s.method.slots(s), s.method.decay) if s.method else (cfg.ttt_steps, cfg.step_decay)
    window = torch.zeros(slots, 3, device=d.device)  # per step (DFlash: per slot): loss sum, hits, counted rows
    tokens, t_window = 0, time.monotonic()
    log = JsonlAppender(s.out.path / LOG_FILE, sync_every=1) if d.main else None
    heap = HeapTrimmer()
    # closed before an error propagates, so that the error's line is not appended to the bar's
    with tqdm(total=total, initial=s.start, disable=not d.main, desc="train", unit="step", dynamic_ncols=True) as bar:
        s.module.train()
        t_loop, stop = time.monotonic(), False
        for batch in prefetch(s.shards, _plan(s), cfg.max_len, cfg.batching == "packed"):
            tokens += int(batch["length"].sum())
            loss, stats = s.method.forward(s, batch)[:2] if s.method else _forward(s, batch)
            # DDP/FSDP average gradients over ranks; the loss is already a global-batch mean, so undo the average.
            (loss * d.world).backward()
            gnorm = torch.nn.utils.clip_grad_norm_(s.trainable, cfg.grad_clip)
            s.opt.step()
            s.sched.step()
            s.opt.zero_grad(set_to_none=True)
            window += stats
            heap.after_step()
            bar.update(1)
            s.step += 1
            if s.step % cfg.log_every == 0 or s.step == total:
                s.last = _log_record(window, tokens, t_window, s.step, total, s.recipe.steps_per_epoch, s.sched, gnorm,
                                     decay, d)
                _write_log(s, log, s.last, bar)
                window.zero_()
                tokens, t_window = 0, time.monotonic()
            stop = _maybe_validate(s, log, bar)
            if stop or s.step % cfg.ckpt_every == 0 or s.step == total or _shards_due(s):
                _checkpoint(s, train_s=s.train_s + time.monotonic() - t_loop)
            if stop:
                break
        if not stop and s.step < total:  # shard order, one pass: the data ran out before the recipe's steps
            s.recipe = dataclasses.replace(s.recipe, total_steps=s.step)
            _maybe_validate(s, log, bar)
            _checkpoint(s, train_s=s.train_s + time.monotonic() - t_loop)
    s.train_s += time.monotonic() - t_loop
    if log is not None:
        log.close()
    if d.main and (line := heap.summary()):
        say(line)


def _write_log(s: RunState, log: JsonlAppender | None, record: dict[str, Any], bar: tqdm) -> None:
    if s.d.main:
        log.write(record)
        short = _short(record) if "loss" in record else _short_val(record)
        bar.set_postfix_str(short)
        say(f"step {record['step']}/{s.recipe.total_steps} " + short
            + (f" {record['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in record else ""))


def _maybe_validate(s: RunState, log: JsonlAppender | None, bar: tqdm) -> bool:
    """Validate on schedule (and at the last step); keep the best draft; True when training should stop."""
    every = s.recipe.eval_every
    if not every or (s.step % every and s.step != s.recipe.total_steps):
        return False
    record = s.method.validate(s) if s.method else _validate(s)
    _write_log(s, log, record, bar)
    b = s.best
    if b["score"] is None or record["val_predicted"][-1] > b["score"] + 1e-3:
        b.update(step=s.step, score=record["val_predicted"][-1], stale=0, val=record)
        model_sd, _ = parallel.state_dicts(s.module, s.opt)
        if s.d.main:
            write_checkpoint(s.out.path / CKPT_DIR / BEST_FILE, {"step": s.step, "model": model_sd, "val": record})
    else:
        b["stale"] += 1
    if s.cfg.patience and b["stale"] >= s.cfg.patience and s.step < s.recipe.total_steps:
        if s.d.main:
            say(f"stopping early at step {s.step}: no better validation in {b['stale']} evaluations "
                f"(best at step {b['step']}; --patience {s.cfg.patience})")
        return True
    return False


@torch.no_grad()
def _validate(s: RunState) -> dict[str, Any]:
    """Per-step TTT loss and top-1 accuracy on the validation slice (every rank a share of each batch), and
    the acceptance length predicted for 1..ttt_steps speculative tokens: the validation samples decoded
    again as a greedy verifier would accept the draft's chains (replay_acceptance), beside the chain
    product of the per-step accuracies."""
    s.module.eval()
    bs, steps = s.recipe.batch_size, s.cfg.ttt_steps
    chunks = (s.val_idx[i:i + bs] for i in range(0, len(s.val_idx), bs))
    plan = (rank_share(c, s.lengths, s.d.rank, s.d.world) for c in chunks)
    window = torch.zeros(steps, 3, device=s.d.device)
    replay = torch.zeros(steps, 2, device=s.d.device)  # per spec-token count: drafts, accepted tokens
    for batch in prefetch(s.shards, plan, s.cfg.max_len, s.cfg.batching == "packed"):
        leads: list[torch.Tensor] = []
        window += _forward(s, batch, leads)[1]
        samples = zip(per_sample(leads[0].cpu(), batch["spans"]), per_sample(batch["loss_mask"], batch["spans"]))
        for lead, mask in ((a.tolist(), b.tolist()) for a, b in samples):
            for k in range(steps):
                replay[k] += torch.tensor(replay_acceptance(lead, mask, k + 1), device=s.d.device)
    s.module.train()
    w = parallel.all_sum(window, s.d).cpu()
    r = parallel.all_sum(replay, s.d).cpu()
    counted = w[:, 2].clamp(min=1)
    acc = (w[:, 1] / counted).tolist()
    return {"step": s.step, "val_loss": round(sum(s.cfg.step_decay**k * v for k, v in
                                                  enumerate((w[:, 0] / counted).tolist())), 5),
            "val_step_acc": [round(a, 5) for a in acc],
            "val_predicted": [round(1 + float(a / max(1.0, float(d))), 4) for d, a in r.tolist()],
            "val_chain_product": [round(predicted_acceptance(acc, k), 4) for k in range(1, steps + 1)]}


def _finish(s: RunState, t_start: float) -> None:
    """Export the best validated draft (or the last one without validation), plot, and complete the manifest."""
    use_best = s.best["step"] is not None  # the same on every rank; only the main one reads the file
    model_sd = None if use_best else parallel.state_dicts(s.module, s.opt)[0]  # collective under FSDP
    if not s.d.main:
        return
    if use_best:
        try:
            model_sd = read_checkpoint(s.out.path / CKPT_DIR / BEST_FILE)["model"]
        except DatasetError as e:
            raise DatasetError(f"{e.message}; export a step checkpoint instead (`eyas-train export {s.out.name}`, "
                               f"or --step N)") from None
    state = {k.removeprefix("draft."): v for k, v in model_sd.items()}
    if s.method:
        s.method.export(s, state)
    else:
        write_draft(s.out.path, state, s.dcfg, s.aux_layers, s.target)
    plot_log(s.out.path / LOG_FILE, s.out.path / PLOT_FILE)
    val = s.best["val"]
    stats = {"steps": s.step, "train_s": round(s.train_s, 1), "wall_s": round(time.monotonic() - t_start, 1),
             "exported_step": s.best["step"] if use_best else s.step,
             "stopped_early": s.step < s.recipe.total_steps, "vocab_coverage": s.vocab.coverage,
             "distinct_tokens": s.vocab.distinct, "draft_vocab": s.vocab.d2t.numel(),
             "final": s.last or _last_record(s.out.path / LOG_FILE), "val": val,
             "predicted_acceptance": val and dict(zip(map(str, range(1, len(val["val_predicted"]) + 1)),
                                                      val["val_predicted"]))}
    log_records = sum(1 for _ in iter_jsonl(s.out.path / LOG_FILE)) if (s.out.path / LOG_FILE).exists() else 0
    manifest = s.out.read_manifest()
    if s.cfg.order == "shards":  # the hidden dataset as it is now (it may have grown since the run began)
        manifest["inputs"] = _lineage(s.shards.ds, s.shards.manifest)
    write_model_card(s.out.path, {**manifest, "stats": stats}, s.out.name)
    finalize(s.out, manifest, stats=stats, records={LOG_FILE: log_records})
    say(f"wrote {s.out.path}: {s.train_s:.0f}s of training over all sessions, "
        f"{time.monotonic() - t_start:.0f}s in this one")
    if val:
        # EAGLE-3 at the K it is usually served at; DFlash at its block size - 1, the K it is served at
        k = len(val["val_predicted"]) if s.method else min(PREDICT_SPEC_TOKENS, len(val["val_predicted"]))
        say(f"validation at step {s.best['step']}: accuracy per step " + "/".join(f"{a:.2f}" for a in
            val["val_step_acc"]) + f"; predicted acceptance length at {k} speculative tokens "
            f"{val['val_predicted'][k - 1]:.2f} (the validation samples replayed as a greedy verifier accepts "
            f"the draft's chains; the chain product 1 + a0 + a0 a1 + ... says {val['val_chain_product'][k - 1]:.2f}; "
            f"`eyas-train eval` measures it)")


def _prepare_folder(out: Dataset, manifest: dict[str, Any], start: int) -> None:
    """Write the partial manifest (from _open); a fresh run starts an empty log, a resumed one cuts the log
    back to its step (a torn last line, left by a kill, is dropped)."""
    out.path.mkdir(parents=True, exist_ok=True)
    log = out.path / LOG_FILE
    if start == 0:
        log.unlink(missing_ok=True)
    elif log.exists():
        fix = (f"delete it (it only records the training: the checkpoints hold the run) and rerun the same command to "
               f"resume from step {start}")
        write_jsonl_atomic(log, [r for _, r in iter_jsonl(log, torn_end_ok=True, fix=fix) if r["step"] <= start])
    out.write_manifest(manifest)


def _log_record(window: torch.Tensor, tokens: int, t0: float, step: int, total: int, per_epoch: int,
                sched: Any, gnorm: torch.Tensor, decay: float, d: parallel.Dist) -> dict[str, Any]:
    """The interval's record, summed over ranks: per-step mean loss and top-1 accuracy, and their
    weighted total (the training objective's value)."""
    w = parallel.all_sum(window.clone(), d).cpu()
    n_tok = int(parallel.all_sum(torch.tensor([tokens], device=d.device), d).item())
    counted = w[:, 2].clamp(min=1)
    step_loss, step_acc = (w[:, 0] / counted).tolist(), (w[:, 1] / counted).tolist()
    return {
        "step": step, "epoch": round(step / per_epoch, 3), "total_steps": total,
        "lr": sched.get_last_lr()[0],
        "loss": sum(decay**k * v for k, v in enumerate(step_loss)),
        "step_loss": [round(v, 5) for v in step_loss],
        "step_acc": [round(v, 5) for v in step_acc],
        "grad_norm": float(gnorm),
        "tokens_per_s": n_tok / max(1e-9, time.monotonic() - t0),
    }


def _short(r: dict[str, Any]) -> str:
    return f"loss {r['loss']:.3f} acc " + "/".join(f"{a:.2f}" for a in r["step_acc"])


def _short_val(r: dict[str, Any]) -> str:
    return (f"validation loss {r['val_loss']:.3f} acc " + "/".join(f"{a:.2f}" for a in r["val_step_acc"])
            + f" predicted acceptance {r['val_predicted'][-1]:.2f} at {len(r['val_predicted'])} draft tokens")


def _last_record(log: Path) -> dict[str, Any] | None:
    last = None
    for _, r in iter_jsonl(log):
        last = r if "loss" in r else last
    return last


def _checkpoint(s: RunState, *, train_s: float) -> None:
    model_sd, opt_sd = parallel.state_dicts(s.module, s.opt)  # collective under FSDP: every rank takes part
    if s.d.main:
        v = s.vocab
        epoch, batch = divmod(s.step, s.recipe.steps_per_epoch)
        save_checkpoint(s.out.path, {
            "step": s.step, "epoch": epoch, "batch_in_epoch": batch, "train_s": train_s, "config": s.cfg.to_dict(),
            "model": model_sd, "optim": opt_sd, "sched": s.sched.state_dict(), "rng": rng_state(), "best": s.best,
            "vocab": {"d2t": v.d2t, "t2d": v.t2d, "coverage": v.coverage, "distinct": v.distinct},
            "expected_samples": s.recipe.train_samples + s.recipe.val_samples, "recipe": s.recipe.to_dict(),
            "val_ids": [s.shards.samples[i].sample_id for i in s.val_idx],
        }, s.cfg.keep_ckpts)
    if _consuming_now(s):
        due = s.consumption.due(s.step)
        if s.d.main:
            _consume(s, due)
        s.consumption.done.update(due)  # on every rank: _shards_due must agree
    parallel.barrier(s.d)


def _consuming_now(s: RunState) -> bool:
    """--consume with a one-pass recipe: shards go as the run passes them (otherwise all at the end)."""
    return s.consumption is not None and s.recipe.total_steps <= s.recipe.steps_per_epoch


def _shards_due(s: RunState) -> bool:
    """Shards are past their last use now. They are freed at once (a checkpoint, then the deletion), not at the
    next --ckpt-every: extract may be waiting under its --disk-budget for exactly these, and this run for
    extract's next shards. The same on every rank: it follows the plan, not the clock."""
    return _consuming_now(s) and bool(s.consumption.due(s.step))


def _consume(s: RunState, shards: list[int]) -> None:
    """Delete shards used for the last time (their last step is in a checkpoint), marked in the hidden manifest."""
    if shards:
        names = [shard_name(j) for j in shards]
        consume(s.shards.ds, names, by=s.out.ref, step=s.step)
        run = shards[-1] - shards[0] == len(shards) - 1  # a contiguous run of shards, or one
        which = f"{names[0]} .. {names[-1]}" if run and len(names) > 1 else ", ".join(names[:3]) + \
            (f" and {len(names) - 3} more" if len(names) > 3 else "")
        say(f"consumed {len(shards)} shard(s) of {s.shards.ds.ref} (--consume): {which}")


def _refuse_budget_deadlock(s: RunState, upto: int) -> None:
    """Stop when extract waits for room under its --disk-budget that only this run could free, while this run
    waits for shard upto-1. Waiting here, the run frees nothing before that shard comes: what was past its
    last use went at once (_shards_due), the validation shards go at the end, and so does everything when
    the recipe takes more than one pass. Only this run deletes shards, so the two would wait for ever."""
    blocked = extract_blocked(s.shards, upto) if s.consumption else None
    if blocked is None:
        return
    if _consuming_now(s):
        # At most on disk at once: the validation shards, the shards of the < B samples a batch carries into
        # the next window, and that window's W shards (the last of them being written).
        keep, carry, w = len(s.consumption.keep), s.recipe.batch_size - 1, s.cfg.window_shards
        largest, most = largest_shard(s.shards, blocked[0]), keep + carry + w
        fix = f"rerun extract with --disk-budget {size_text(most * largest)} or more, or lower --window-shards"
    else:
        fix = f"give extract a --disk-budget that holds the whole dataset, or train one pass (--epochs 1)"
    raise deadlock_error(s.shards, *blocked, fix=fix)


def _refuse_first_window_deadlock(shards: HiddenShards, cfg: TrainConfig) -> None:
    """The same before the first window is there: nothing is trained, so nothing can be freed, until it is."""
    blocked = extract_blocked(shards, cfg.window_shards)
    if blocked is not None:
        w, largest = cfg.window_shards, largest_shard(shards, blocked[0])
        raise deadlock_error(shards, *blocked, fix=f"rerun extract with --disk-budget well above "
                             f"{size_text(w * largest)}, or lower --window-shards")


def export_checkpoint(name: str, *, step: int | None = None, out: str | None = None, model: str | Path | None = None,
                      data_root: Path | None = None) -> Path:
    """Export checkpoint `step` (default: the newest) of drafts/NAME into NAME, or into a new drafts/OUT.

    Into NAME, the dataset becomes complete only when the checkpoint is the run's last step (an earlier
    step is written but the status stays partial); drafts/OUT is a complete snapshot with its own lineage.
    A failed export into OUT removes the folder it made, so the same command can be run again. `model`: the
    target's folder where it is now (default: where it was when the draft was trained).
    """
    src, m = open_input(name, "drafts", allow_partial=True, root=data_root)  # an unknown schema is refused
    found = {int(p.stem.removeprefix("step-")): p for p in checkpoints(src.path)}
    chosen = max(found) if step is None and found else step
    if chosen not in found:
        raise DatasetError(f"{src.ref}: no checkpoint at step {chosen}; have {sorted(found) or 'none'}")
    target = _export_target(src, m, model)
    dest = src if out is None else Dataset.parse(out, "drafts", data_root)
    with WriterLock(dest, stage="03_train export"):
        if dest != src and (dest.path.exists() or dest.path.is_symlink()):
            raise DatasetError(f"--out {dest.ref}: {dest.path} already exists; export never overwrites a dataset: "
                               f"pick another --out, or delete it first with `eyas-data rm {dest.ref}`")
        try:
            return _export(src, m, dest, chosen, _export_checkpoint(found, chosen), target)
        except BaseException:
            if dest != src:  # it did not exist before (above), so all of it is this export's own
                shutil.rmtree(dest.path, ignore_errors=True)
            raise


def _export_checkpoint(found: dict[int, Path], chosen: int) -> dict[str, Any]:
    """Checkpoint `chosen` of `found` (step -> path); an unreadable one is refused naming a readable step."""
    try:
        return read_checkpoint(found[chosen])
    except DatasetError as e:
        good = readable_checkpoint([found[k] for k in sorted(found) if k != chosen])
        step = {path: k for k, path in found.items()}.get(good)
        instead = (f"export --step {step}, the newest readable checkpoint, instead (and delete the damaged one)"
                   if good else f"no other checkpoint is readable: delete it and retrain with {REMAKE['drafts']}")
        raise DatasetError(f"{e.message}; {instead}") from None


def _export_target(src: Dataset, m: dict[str, Any], model: str | Path | None) -> dict[str, Any]:
    """The (text) config of the target the draft was trained for, which export writes token ids and dtype from:
    from `model` (checked against the draft's target), else from where the target was at training time."""
    trained = m["params"]["config"]["model"]
    try:
        target = read_text_config(model or trained)
    except (OSError, ValueError) as e:  # moved or deleted since; a malformed config.json
        fix = "pass --model with the target's folder where it is now" if model is None else \
            f"pass the target {src.ref} was trained for (at {trained} then)"
        raise DatasetError(f"{src.ref} was trained for the target at {trained}: {e}; {fix}") from None
    if model is not None:
        check_target(src, m, target_fingerprint(load_tokenizer(model), model))
        differ = target_mismatch(target, m["params"]["draft"])
        if differ:
            raise DatasetError(f"--model {model} is not the target {src.ref} was trained for: its config.json has "
                               f"{', '.join(differ)}; pass that target (at {trained} then)")
    return target


def _export(src: Dataset, m: dict[str, Any], dest: Dataset, chosen: int, ckpt: dict[str, Any],
            target: dict[str, Any]) -> Path:
    p = m["params"]
    state = {k.removeprefix("draft."): v for k, v in ckpt["model"].items()}
    if p["config"].get("method") == "dflash":
        from eyas_train.dflash_export import reexport

        reexport(dest.path, state, p, target)
    else:
        write_draft(dest.path, state, DraftConfig(**p["draft"]), p["aux_layers"], target)
    stats = {**m.get("stats", {}), "exported_step": chosen}
    if dest == src:
        write_model_card(dest.path, {**m, "stats": stats}, dest.name)
        if chosen == p["total_steps"] or m.get("status") == "complete":  # a complete one's files are hashed again
            finalize(src, m, stats=stats)
        else:
            m["stats"] = stats
            src.write_manifest(m)
            say(f"exported step {chosen} of {p['total_steps']} into {src.ref}; it stays partial "
                       f"(training unfinished): use --out NAME for a complete snapshot")
    else:
        snap = new_manifest("drafts", stage="03_train", target=m.get("target"),
                            inputs=[input_ref(src)] + m.get("inputs", []), params={**p, "exported_from": src.ref})
        dest.path.mkdir(parents=True, exist_ok=True)
        write_model_card(dest.path, {**snap, "stats": stats}, dest.name)
        finalize(dest, snap, stats=stats)
    return dest.path
