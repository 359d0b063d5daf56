"""`eyas-train run`: hidden dataset -> trained EAGLE-3 draft in drafts/NAME (resumable, torchrun-aware).

drafts/NAME/ and its files are described in eyas_common.drafts, the format's owner.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.contract import (REMAKE, Dataset, DatasetError, JsonlAppender, add_producer, check_target, finalize,
                                  fsync_dir, input_ref, iter_jsonl, new_manifest, open_input)
from eyas_common.drafts import CKPT_DIR, LOG_FILE, PLOT_FILE, checkpoint_name, checkpoint_paths
from eyas_common.lock import WriterLock
from eyas_common.procs import INTERRUPTED, sigterm_as_interrupt
from eyas_train import parallel
from eyas_train.config import TrainConfig
from eyas_common.hidden import HiddenShards
from eyas_train.data import global_batches, prefetch, rank_share, token_counts
from eyas_train.export import write_draft
from eyas_train.init_draft import check_fits, init_vocab, load_into, read_init_draft, run_config
from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.plot import plot_log
from eyas_train.target import Teacher, load_embedding, load_lm_head, load_weight, text_config
from eyas_train.ttt import UnrolledLoss, step_counts
from eyas_train.vocab import VocabMap, build_vocab



def say(msg: str) -> None:
    """A progress line on stderr that does not break the progress bar."""
    tqdm.write(f"[eyas-train] {msg}", file=sys.stderr)


def draft_config(target: dict[str, Any], hidden_size: int, vocab_size: int, n_aux: int, draft_vocab: int,
                 norm_before_residual: bool) -> DraftConfig:
    """The draft's shape from the target's config: same width, heads and FFN as one target layer."""
    heads = target["num_attention_heads"]
    # MLA targets (DeepseekV3 / Kimi) have no Llama head_dim; the draft's Llama layer splits H evenly.
    head_dim = (None if "kv_lora_rank" in target else target.get("head_dim")) or hidden_size // heads
    rope = dict(target.get("rope_parameters") or target.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", target.get("rope_theta", 10000.0))
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


def lr_lambda(total: int, warmup: float):
    """Linear warm-up over `warmup` of the steps, then cosine decay to 0 at `total`."""
    w = max(1, int(total * warmup))

    def f(step: int) -> float:
        if step < w:
            return (step + 1) / w
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - w) / max(1, total - w))))

    return f


# ------------------------------------------------------------------------------------------------
# checkpoints


def checkpoints(folder: Path) -> list[Path]:
    return checkpoint_paths(folder)


def save_checkpoint(folder: Path, payload: dict[str, Any], keep: int) -> Path:
    """torch.save to a temp file, fsync, rename; then drop all but the newest `keep`."""
    d = folder / CKPT_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / checkpoint_name(payload["step"])
    tmp = d / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(d)
    for old in checkpoints(folder)[:-keep]:
        old.unlink()
    return path


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    if s["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


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
    cfg = TrainConfig(hidden=hidden, model=str(model), name=name, **options)
    out = Dataset.parse(name, "drafts", data_root)
    d = parallel.init()
    try:
        # One writer per draft (rank 0 writes for all ranks); SIGTERM stops like Ctrl-C, at the last checkpoint.
        with sigterm_as_interrupt(), WriterLock(out, stage="03_train") if d.main else nullcontext():
            return _run(cfg, d, data_root, allow_code_change)
    except KeyboardInterrupt:
        kept = checkpoints(out.path)
        say(f"interrupted: {out.ref} keeps {kept[-1].name if kept else 'no checkpoint yet'}; "
            f"rerun the same command to resume")
        raise SystemExit(INTERRUPTED) from None
    finally:
        parallel.shutdown(d)


def _open(cfg: TrainConfig, data_root: Path | None):
    hidden_ds, hidden_m = open_input(cfg.hidden, "hidden", root=data_root)
    fingerprint = target_fingerprint(load_tokenizer(cfg.model, cfg.trust_remote_code), cfg.model)
    check_target(hidden_ds, hidden_m, fingerprint)
    out = Dataset.parse(cfg.name, "drafts", data_root)
    if out.exists() and out.read_manifest().get("status") == "complete":
        raise DatasetError(f"{out.ref} is already complete; choose another name, or delete it with "
                           f"`eyas-data rm {out.ref}` to train again")
    return hidden_ds, hidden_m, fingerprint, out


def _lineage(hidden_ds: Dataset, hidden_m: dict[str, Any]) -> list[dict[str, str]]:
    # The hidden dataset itself, then what it was made from (the synth dataset), so the draft traces to both.
    return [input_ref(hidden_ds)] + [i for i in hidden_m.get("inputs", []) if isinstance(i, dict)]


def _run(cfg: TrainConfig, d: parallel.Dist, data_root: Path | None, allow_code_change: bool = False) -> Path:
    t_start = time.monotonic()
    hidden_ds, hidden_m, fingerprint, out = _open(cfg, data_root)
    params = hidden_m["params"]
    target = text_config(cfg.model)
    hidden_size, aux_layers = int(params["hidden_size"]), list(params["layers"])
    vocab_size = int(params.get("vocab_size") or target["vocab_size"])
    shards = HiddenShards(hidden_ds, hidden_m)  # exactly the manifest's files, sizes checked
    width = shards.read(shards.samples[0], 1)["aux"].shape[-1]
    if width != len(aux_layers) * hidden_size:
        raise DatasetError(f"{hidden_ds.ref}: aux rows are {width} wide, but the manifest says {len(aux_layers)} "
                           f"layers of {hidden_size}; rerun {REMAKE['hidden']}")
    if cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} is not a multiple of the {d.world} processes")

    found = checkpoints(out.path)
    ckpt = torch.load(found[-1], map_location="cpu", weights_only=False) if found else None
    if ckpt is not None:
        changed = cfg.differences(ckpt["config"])
        if changed:
            raise DatasetError(f"{out.ref} has a checkpoint at step {ckpt['step']} made with other settings "
                               f"({'; '.join(changed)}): rerun with the same settings to resume, or delete it "
                               f"with `eyas-data rm {out.ref}`")
        vocab = vocab_from(ckpt["vocab"])
    init = read_init_draft(cfg.init_draft, data_root) if cfg.init_draft else None
    if init is not None:
        check_fits(init, vocab_size=vocab_size, hidden_size=hidden_size, aux_layers=aux_layers)
        if ckpt is None:
            vocab, report = init_vocab(init, token_counts(shards, vocab_size), cfg.init_vocab, cfg.draft_vocab)
            if d.main:
                say(f"--init-draft {init.source} ({init.layout} layout): {report}")
    elif ckpt is None:
        vocab = build_vocab(token_counts(shards, vocab_size), cfg.draft_vocab)
    dcfg = (run_config(init, vocab) if init is not None else
            draft_config(target, hidden_size, vocab_size, len(aux_layers), vocab.d2t.numel(), cfg.norm_before_residual))

    torch.manual_seed(cfg.seed)
    draft = Eagle3Draft(dcfg)
    draft.init_weights(cfg.seed)
    lm_head = load_lm_head(cfg.model)
    with torch.no_grad():
        draft.embed.weight.copy_(load_embedding(cfg.model))
        draft.d2t.copy_(vocab.d2t)
        draft.t2d.copy_(vocab.t2d)
        # The output end starts as the target's own (its final norm, its lm_head rows of the draft vocab):
        # the layer then only has to produce a state like the target's last residual stream.
        draft.norm.weight.copy_(load_weight(cfg.model, "model.norm.weight"))
        draft.lm_head.weight.copy_(lm_head[vocab.draft_to_target])
    if init is not None:
        load_into(draft, init, vocab)  # a resumed run then loads its checkpoint over it
    teacher = Teacher(vocab, lm_head if shards.teacher == "final" else None, d.device)
    module = parallel.wrap(UnrolledLoss(draft, cfg.ttt_steps, cfg.step_decay).to(d.device), d, cfg.parallel)
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)

    lengths = [min(s.length, cfg.max_len) for s in shards.samples]
    per_epoch = len(shards) // cfg.batch_size
    if per_epoch == 0:
        raise DatasetError(f"{hidden_ds.ref} has {len(shards)} samples, fewer than one batch of {cfg.batch_size}")
    total = cfg.epochs * per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, cfg.warmup))

    start, train_s = 0, 0.0  # train_s: loop time summed over all sessions of the run
    if ckpt is not None:
        parallel.load_state_dicts(module, opt, ckpt["model"], ckpt["optim"])
        sched.load_state_dict(ckpt["sched"])
        set_rng_state(ckpt["rng"])
        start, train_s = ckpt["step"], ckpt["train_s"]
    run_params = {"config": cfg.to_dict(), "draft": dcfg.__dict__, "aux_layers": aux_layers, "world": d.world,
                  "teacher": shards.teacher, "steps_per_epoch": per_epoch, "total_steps": total}
    if d.main:
        _prepare_folder(out, cfg, fingerprint, _lineage(hidden_ds, hidden_m), run_params, start, allow_code_change)
        say(f"{len(shards)} samples, {per_epoch} steps/epoch x {cfg.epochs} epochs = {total} steps on "
            f"{d.world} process(es), {d.device}; draft vocab {vocab.d2t.numel()} of {vocab_size} covers "
            f"{vocab.coverage:.2%} of masked tokens ({vocab.distinct} distinct)"
            + (f"; resuming at step {start}" if start else ""))
    parallel.barrier(d)

    def plan():
        for step in range(start, total):
            epoch, b = divmod(step, per_epoch)
            yield rank_share(global_batches(len(shards), cfg.batch_size, cfg.seed, epoch)[b], lengths, d.rank, d.world)

    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and d.device.type == "cuda")
    autocast = torch.autocast(d.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    window = torch.zeros(cfg.ttt_steps, 3, device=d.device)  # per step: loss sum, hits, counted rows
    tokens, t_window, last = 0, time.monotonic(), None
    log = JsonlAppender(out.path / LOG_FILE, sync_every=1) if d.main else None
    bar = tqdm(total=total, initial=start, disable=not d.main, desc="train", unit="step", dynamic_ncols=True)
    module.train()
    t_loop = time.monotonic()
    for step, batch in enumerate(prefetch(shards, plan(), cfg.max_len), start=start):
        tokens += int(batch["length"].sum())
        batch = {k: v.to(d.device, non_blocking=True) for k, v in batch.items()}
        target_p, target_top = teacher(batch)
        mask = batch["loss_mask"]
        denom = parallel.all_sum(step_counts(mask, cfg.ttt_steps), d)
        with autocast:
            loss, stats = module(batch["input_ids"], batch["aux"].float(), target_p, target_top, mask, denom)
        # DDP/FSDP average gradients over ranks; the loss is already a global-batch mean, so undo the average.
        (loss * d.world).backward()
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        window += stats
        bar.update(1)
        done = step + 1
        if done % cfg.log_every == 0 or done == total:
            last = _log_record(window, tokens, t_window, done, total, per_epoch, sched, gnorm, cfg.step_decay, d)
            if d.main:
                log.write(last)
                bar.set_postfix_str(_short(last))
                say(f"step {done}/{total} " + _short(last) + f" {last['tokens_per_s']:.0f} tok/s")
            window.zero_()
            tokens, t_window = 0, time.monotonic()
        if done % cfg.ckpt_every == 0 or done == total:
            _checkpoint(out, module, opt, sched, cfg, vocab, done, per_epoch,
                        train_s + time.monotonic() - t_loop, d)
    bar.close()
    train_s += time.monotonic() - t_loop

    model_sd, _ = parallel.state_dicts(module, opt)
    if d.main:
        log.close()
        state = {k.removeprefix("draft."): v for k, v in model_sd.items()}
        write_draft(out.path, state, dcfg, aux_layers, target)
        plot_log(out.path / LOG_FILE, out.path / PLOT_FILE)
        m = out.read_manifest()
        finalize(out, m, stats={
            "steps": total, "train_s": round(train_s, 1), "wall_s": round(time.monotonic() - t_start, 1),
            "vocab_coverage": vocab.coverage, "distinct_tokens": vocab.distinct,
            "draft_vocab": vocab.d2t.numel(), "final": last or _last_record(out.path / LOG_FILE)},
            records={LOG_FILE: total // cfg.log_every + (total % cfg.log_every > 0)})
        say(f"wrote {out.path}: {train_s:.0f}s of training over all sessions, "
            f"{time.monotonic() - t_start:.0f}s in this one")
    parallel.barrier(d)
    return out.path


def _prepare_folder(out: Dataset, cfg: TrainConfig, fingerprint: dict[str, Any], inputs: list[dict[str, str]],
                    run_params: dict[str, Any], start: int, allow_code_change: bool = False) -> None:
    """A fresh run starts a partial manifest and an empty log; a resumed one cuts the log back to its step."""
    manifest = new_manifest("drafts", stage="03_train", target=fingerprint, inputs=inputs, params=run_params)
    if start and out.exists():  # a resume: every producer stays on record, another code version only if allowed
        manifest["producers"] = out.read_manifest().get("producers") or []
        add_producer(out, manifest, "03_train", allow_code_change=allow_code_change)
    out.path.mkdir(parents=True, exist_ok=True)
    log = out.path / LOG_FILE
    if start == 0:
        log.unlink(missing_ok=True)
    elif log.exists():
        kept = [r for _, r in iter_jsonl(log) if r["step"] <= start]
        with JsonlAppender(log.with_name(log.name + ".tmp")) as w:
            for r in kept:
                w.write(r)
        os.replace(log.with_name(log.name + ".tmp"), log)
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


def _last_record(log: Path) -> dict[str, Any] | None:
    last = None
    for _, r in iter_jsonl(log):
        last = r
    return last


def _checkpoint(out: Dataset, module: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, cfg: TrainConfig,
                vocab: VocabMap, step: int, per_epoch: int, train_s: float, d: parallel.Dist) -> None:
    model_sd, opt_sd = parallel.state_dicts(module, opt)  # collective under FSDP: every rank takes part
    if d.main:
        epoch, batch = divmod(step, per_epoch)
        save_checkpoint(out.path, {
            "step": step, "epoch": epoch, "batch_in_epoch": batch, "train_s": train_s, "config": cfg.to_dict(),
            "model": model_sd, "optim": opt_sd, "sched": sched.state_dict(), "rng": rng_state(),
            "vocab": {"d2t": vocab.d2t, "t2d": vocab.t2d, "coverage": vocab.coverage, "distinct": vocab.distinct},
        }, cfg.keep_ckpts)
    parallel.barrier(d)


def export_checkpoint(name: str, *, step: int | None = None, out: str | None = None,
                      data_root: Path | None = None) -> Path:
    """Export checkpoint `step` (default: the newest) of drafts/NAME into NAME, or into a new drafts/OUT.

    Into NAME, the dataset becomes complete only when the checkpoint is the run's last step (an earlier
    step is written but the status stays partial); drafts/OUT is a complete snapshot with its own lineage.
    """
    src = Dataset.parse(name, "drafts", data_root)
    m = src.read_manifest()
    found = {int(p.stem.removeprefix("step-")): p for p in checkpoints(src.path)}
    chosen = max(found) if step is None and found else step
    if chosen not in found:
        raise DatasetError(f"{src.ref}: no checkpoint at step {chosen}; have {sorted(found) or 'none'}")
    dest = src if out is None else Dataset.parse(out, "drafts", data_root)
    if dest != src and (dest.path.exists() or dest.path.is_symlink()):
        raise DatasetError(f"--out {dest.ref}: {dest.path} already exists; export never overwrites a dataset: "
                           f"pick another --out, or delete it first with `eyas-data rm {dest.ref}`")
    with WriterLock(dest, stage="03_train export"):
        return _export(src, m, dest, chosen, found[chosen])


def _export(src: Dataset, m: dict[str, Any], dest: Dataset, chosen: int, path: Path) -> Path:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    p = m["params"]
    state = {k.removeprefix("draft."): v for k, v in ckpt["model"].items()}
    write_draft(dest.path, state, DraftConfig(**p["draft"]), p["aux_layers"], text_config(p["config"]["model"]))
    stats = {**m.get("stats", {}), "exported_step": chosen}
    if dest == src:
        if chosen == p["total_steps"]:
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
        finalize(dest, snap, stats=stats)
    return dest.path
