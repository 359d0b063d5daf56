"""`eyas-train run`: hidden dataset -> a trained draft in drafts/NAME, by any method of eyas_train.methods
(resumable, torchrun-aware).

drafts/NAME/ and its files are described in eyas_common.drafts, the format's owner.
"""

from __future__ import annotations

import re
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.checkpoint import read_text_config
from eyas_common.contract import (REMAKE, Dataset, DatasetError, await_start, check_target, finalize, input_ref,
                                  iter_jsonl, open_input, open_output, remake_fix, write_jsonl_atomic)
from eyas_common.drafts import BEST_FILE, CKPT_DIR, LOG_FILE, PLOT_FILE, read_checkpoint
from eyas_common.hidden import HiddenShards, consuming
from eyas_common.launch import INTERRUPTED
from eyas_common.lock import WriterLock
from eyas_common.model_card import write_model_card
from eyas_common.procs import sigterm_as_interrupt
from eyas_train import parallel
from eyas_train.checkpoints import checkpoints, resume_checkpoint
from eyas_train.config import MAY_CHANGE, TrainConfig
from eyas_train.data import refuse_no_targets
from eyas_train.loop import last_record, train_loop
from eyas_train.methods import REGISTRY, unsupported
from eyas_train.methods.base import Inputs
from eyas_train.order import consume_shards, split
from eyas_train.plot import plot_log
from eyas_train.state import RunState, optimiser, resumed, say
from eyas_train.target import check_model
from eyas_train.stream import Consumption


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
    refusal = unsupported(cfg.method, cfg.to_dict(), TrainConfig.defaults())
    if refusal:
        raise refusal
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
    current = lineage(hidden_ds, hidden_m)
    stored = out.read_manifest() if cfg.order == "shards" and out.manifest_path.exists() else {}
    inputs = stored.get("inputs") or []
    if stored.get("status") != "complete" and inputs[:1] and inputs[0].get("ref") == hidden_ds.ref:
        return inputs
    return current


def lineage(hidden_ds: Dataset, hidden_m: dict[str, Any]) -> list[dict[str, str]]:
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
    train_loop(s)
    _finish(s, t_start)
    if s.consumption and d.main:
        # Every shard listed is past its last use now, the validation shards too, and so are those a run that
        # ended before the data (an early stop, a shorter schedule) never reached: the dataset serves it alone.
        if not s.shards.complete:
            s.shards.grow()
        consume_shards(s, sorted(set(range(len(s.shards.files))) - s.consumption.done))
    parallel.barrier(d)
    return out.path


def _setup(cfg: TrainConfig, d: parallel.Dist, hidden_ds: Dataset, hidden_m: dict[str, Any], out: Dataset,
           ckpt: dict[str, Any] | None, data_root: Path | None) -> RunState:
    """Read the hidden dataset, split it and resolve the recipe; the method builds the draft; resume `ckpt`."""
    params = hidden_m["params"]
    hidden_size, aux_layers = int(params["hidden_size"]), list(params["layers"])
    # the manifest's files, sizes checked; shards this draft consumed are counted, not read
    shards = HiddenShards(hidden_ds, hidden_m, follow=cfg.follow, consumer=out.ref)
    if cfg.batch_size is not None and cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} is not a multiple of the {d.world} processes")
    try:
        train_idx, val_idx, recipe, vocab_shards = split(cfg, d, shards, hidden_m, hidden_size, ckpt)
    except ValueError as e:
        raise DatasetError(f"{hidden_ds.ref}: {e}") from None
    width = shards.read(shards.samples[0], 1)["aux"].shape[-1]
    if width != len(aux_layers) * hidden_size:
        raise DatasetError(f"{hidden_ds.ref}: aux rows are {width} wide, but the manifest says {len(aux_layers)} "
                           f"layers of {hidden_size}; rerun {REMAKE['hidden']}")
    lengths = [min(x.length, cfg.max_len) for x in shards.samples]
    if ckpt is None:  # checked when the run began (a resumed one has the same --max-len; its shards may be consumed)
        refuse_no_targets(hidden_ds, shards, cfg.max_len)
    target = read_text_config(cfg.model)
    b = REGISTRY[cfg.method].build(Inputs(cfg, d, hidden_ds, shards, vocab_shards, target, hidden_size, aux_layers,
                                          out, ckpt, data_root, say))
    opt, sched = optimiser(cfg, b.module, recipe)
    s = RunState(cfg, d, out, shards, recipe, train_idx, val_idx, lengths, b.vocab, b.dcfg, aux_layers, target,
                 b.module, opt, sched, b.method)
    if cfg.consume:
        s.consumption = Consumption(shards, val_idx)
    return resumed(s, ckpt)


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
    s.method.export(s, state)
    plot_log(s.out.path / LOG_FILE, s.out.path / PLOT_FILE)
    val = s.best["val"]
    stats = {"steps": s.step, "train_s": round(s.train_s, 1), "wall_s": round(time.monotonic() - t_start, 1),
             "exported_step": s.best["step"] if use_best else s.step,
             "stopped_early": s.step < s.recipe.total_steps, "vocab_coverage": s.vocab.coverage,
             "distinct_tokens": s.vocab.distinct, "draft_vocab": s.vocab.d2t.numel(),
             "final": s.last or last_record(s.out.path / LOG_FILE), "val": val,
             "predicted_acceptance": val and dict(zip(map(str, range(1, len(val["val_predicted"]) + 1)),
                                                      val["val_predicted"]))}
    log_records = sum(1 for _ in iter_jsonl(s.out.path / LOG_FILE)) if (s.out.path / LOG_FILE).exists() else 0
    manifest = s.out.read_manifest()
    if s.cfg.order == "shards":  # the hidden dataset as it is now (it may have grown since the run began)
        manifest["inputs"] = lineage(s.shards.ds, s.shards.manifest)
    write_model_card(s.out.path, {**manifest, "stats": stats}, s.out.name)
    finalize(s.out, manifest, stats=stats, records={LOG_FILE: log_records})
    say(f"wrote {s.out.path}: {s.train_s:.0f}s of training over all sessions, "
        f"{time.monotonic() - t_start:.0f}s in this one")
    if val:
        k = s.method.reported_k(len(val["val_predicted"]))
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
