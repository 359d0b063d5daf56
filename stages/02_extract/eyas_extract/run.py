"""eyas-extract run: a synth dataset and its target -> EAGLE-3 hidden states in `hidden/NAME/`.

Files of a hidden dataset:
    shard-{i:05d}.safetensors   the states (shards.py documents the tensors); final names only by rename
    runs/worker-W-of-N.json     each worker's last run: tokens, seconds (merged into the manifest stats)
    manifest.json               schema eyas.hidden/1; params = ExtractConfig; inputs = the synth dataset
Work is cut into shards from the synth dataset alone (batching.py), and shard j belongs to worker
j mod W, where W = (--shard parts) x (torchrun ranks). A rerun skips the shards already there and
redoes the rest, so a killed run resumes by rerunning it. The last worker to finish (or
`eyas-extract finalize NAME`) checks that every shard is there, then marks the dataset complete.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from eyas_common.chat import load_tokenizer, refuse_remote_code, target_fingerprint
from eyas_common.checkpoint import read_checkpoint_size
from eyas_common.contract import (REMAKE, Dataset, DatasetError, check_schema, check_target, finalize, input_ref,
                                  new_manifest, open_input, verify, write_json_atomic)

from eyas_extract.batching import index_samples, load_tokens, make_batches, plan_shards
from eyas_extract.config import AUX_DTYPES, BACKENDS, FIXED_PARAMS, TEACHERS, ExtractConfig
from eyas_extract.hf_backend import pick_attn, pick_device, pick_dtype
from eyas_extract.placement import Devices, Plan, estimate_seconds, plan_placement, tokens_note
from eyas_extract.shards import ShardWriter, bytes_per_token, shard_layout, shard_name

SAMPLES = "samples.jsonl"
RUNS = "runs"


def log(msg: str) -> None:
    print(f"[extract] {msg}", file=sys.stderr, flush=True)


def parse_shard(shard: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise DatasetError(f"bad --shard {shard!r}: expected I/N with 0 <= I < N, e.g. 0/2 and 1/2 on two hosts")
    return i, n


def _ranks() -> tuple[int, int, int]:
    """(rank, world size, local rank) under torchrun; (0, 1, 0) otherwise."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def default_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def _model_dims(model: Path, trust_remote_code: bool) -> tuple[int, int, int]:
    from transformers import AutoConfig

    try:
        text = AutoConfig.from_pretrained(str(model), trust_remote_code=trust_remote_code).get_text_config()
    except ValueError as e:
        refuse_remote_code(model, e, trust_remote_code)
        raise
    return text.num_hidden_layers, text.hidden_size, text.vocab_size


def _place(cfg: ExtractConfig, model: Path, devices: str | None, world: int, max_memory: dict[str, str] | None,
           tokens: int, quiet: bool) -> Plan:
    """Plan where the target goes (placement.py), print the plan, and put its choices into `cfg`."""
    size = read_checkpoint_size(model)
    found = Devices.parse(devices) if devices else Devices.detect()
    plan = plan_placement(size=size, devices=found, dtype=cfg.dtype, backend=cfg.backend, nproc=world,
                          device_map=cfg.device_map)
    if plan.kind == "device_map":
        cfg.device_map = cfg.device_map or "auto"
        cfg.max_memory = max_memory or plan.max_memory
    elif max_memory:
        raise DatasetError("--max-memory applies to a device_map placement; pass --device-map auto with it")
    cfg.tensor_parallel_size, cfg.enable_expert_parallel = plan.tensor_parallel_size, plan.enable_expert_parallel
    cfg.placement = plan.describe()
    if not quiet:
        log(f"placement: {cfg.placement}")
        log(f"estimated time: {tokens_note(tokens, estimate_seconds(plan, size, found, tokens))}")
    return plan


def _open_dataset(ds: Dataset, cfg: ExtractConfig, synth: Dataset, target: dict[str, Any],
                  fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The hidden manifest: new, or the existing one after checking it was made the same way."""
    params = asdict(cfg)
    if not ds.exists():
        if list(ds.path.glob("shard-*.safetensors")):
            raise DatasetError(f"{ds.ref}: {ds.path} holds shards but no manifest.json; delete it "
                               f"(`eyas-data rm {ds.ref}`) or pick another --name")
        manifest = new_manifest("hidden", stage="02_extract", target=target, inputs=[input_ref(synth)], params=params)
        ds.path.mkdir(parents=True, exist_ok=True)
        ds.write_manifest(manifest)
        return manifest
    manifest = ds.read_manifest()
    check_schema(ds, manifest)
    check_target(ds, manifest, fingerprint)
    if manifest.get("inputs") != [input_ref(synth)]:
        raise DatasetError(f"{ds.ref} was started from {manifest.get('inputs')}, not from {synth.ref} as it is now "
                           f"(its manifest changed since); delete it (`eyas-data rm {ds.ref}`) or pick another --name")
    old = manifest.get("params", {})
    changed = [f"{k}={old.get(k)!r} (now {params[k]!r})" for k in FIXED_PARAMS if old.get(k) != params[k]]
    if changed:
        raise DatasetError(f"{ds.ref} was made with {', '.join(changed)}; resume it with the same options "
                           f"(and the same synth dataset), or pick another --name")
    return manifest


def _free_bytes(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


class Writer:
    """Stores batches on a thread, so the next forward runs while this one is written.

    Rows on a GPU are copied to pinned host memory without blocking; the thread waits for that copy.
    An error on the thread is raised at the next submit or at close.
    """

    def __init__(self) -> None:
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=8)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="eyas-extract-writer", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.q.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 - handed to the main thread
                    self.error = e

    def put(self, job: Callable[[], None]) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(job)

    def submit(self, shard: ShardWriter, samples: list[int], rows: dict[str, torch.Tensor]) -> None:
        ready = None
        if any(t.is_cuda for t in rows.values()):
            host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in rows.items()}
            for k, t in rows.items():
                host[k].copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            rows = host

        def job() -> None:
            if ready is not None:
                ready.synchronize()
            r = 0
            for k in samples:
                n = shard.starts[k + 1] - shard.starts[k]
                shard.put_sample(k, {name: t[r:r + n] for name, t in rows.items()})
                r += n

        self.put(job)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def _interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def run(*, synth: str, model: Path, name: str, backend: str = "hf", layers: list[int] | None = None,
        teacher: str = "final", topk: int = 8, aux_dtype: str = "bf16", shard: str = "0/1",
        shard_samples: int = 2048, shard_mb: int = 2048, batch_tokens: int = 16384, dtype: str = "auto",
        device: str = "auto", attn: str = "auto", device_map: str | None = None, trust_remote_code: bool = False,
        max_memory: dict[str, str] | None = None, devices: str | None = None, dry_run: bool = False,
        data_root: Path | None = None, progress: bool = True) -> dict[str, Any]:
    """Extract (or resume) hidden dataset `name` from synth dataset `synth`; returns this worker's stats."""
    t_start = time.monotonic()
    if backend not in BACKENDS or teacher not in TEACHERS or aux_dtype not in AUX_DTYPES:
        raise DatasetError(f"backend {backend!r}, teacher {teacher!r}, aux dtype {aux_dtype!r}: "
                           f"expected one of {BACKENDS}, {TEACHERS}, {AUX_DTYPES}")
    part, parts = parse_shard(shard)
    if devices and not dry_run:
        raise DatasetError(f"--devices {devices!r} describes another machine: use it with --dry-run only")
    rank, world, local_rank = _ranks()
    if world > 1 and (backend == "vllm" or device_map):
        raise DatasetError("under torchrun each rank runs its own copy of the target on its own GPU: --backend vllm "
                           "and --device-map need a process of their own; split hosts or GPUs with --shard I/N instead")
    # Host I of N keeps shards j = I mod N; its ranks split those further. Worker w takes j = w mod W.
    workers, worker = parts * world, part + parts * rank
    model = Path(model)
    if backend == "vllm":
        from eyas_extract.vllm_backend import require_vllm

        require_vllm()

    # The input, refused when partial, corrupted, unknown or made for another tokenizer.
    sds, smanifest = open_input(synth, "synth", root=data_root)
    problems = verify(sds)
    if problems:
        raise DatasetError(f"{sds.ref} is corrupted: {'; '.join(problems[:3])}. Check it with `eyas-data verify "
                           f"{sds.ref}`, then remake it with {REMAKE['synth']}")
    fingerprint = target_fingerprint(load_tokenizer(model, trust_remote_code), model)
    check_target(sds, smanifest, fingerprint)

    num_layers, hidden, vocab = _model_dims(model, trust_remote_code)
    layers = list(layers) if layers else default_layers(num_layers)
    if len(set(layers)) != len(layers) or not all(0 <= k < num_layers for k in layers):
        raise DatasetError(f"--layers {layers}: need distinct ids in [0, {num_layers}) (id k is the state entering "
                           f"layer k; the target has {num_layers} layers, default {default_layers(num_layers)})")
    if teacher == "topk" and not 1 <= topk <= vocab:
        raise DatasetError(f"--topk {topk}: need 1 <= K <= {vocab} (the target's vocabulary)")
    dev = pick_device(device)
    if dev.type == "cuda" and world > 1:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    compute = pick_dtype(dtype, dev)
    cfg = ExtractConfig(
        synth=sds.ref, model=str(model), backend=backend, layers=layers, num_layers=num_layers, hidden_size=hidden,
        vocab_size=vocab, aux_dtype=aux_dtype, teacher=teacher, topk=topk if teacher == "topk" else 0,
        shard_samples=shard_samples, shard_tokens=0, num_shards=0, batch_tokens=batch_tokens,
        dtype=compute, attn=pick_attn(attn, dev, compute), device_map=device_map,
        trust_remote_code=trust_remote_code)
    bpt = bytes_per_token(cfg)
    cfg.shard_tokens = max(1, shard_mb * (1 << 20) // bpt)

    samples_path = sds.path / SAMPLES
    plan = plan_shards(index_samples(samples_path, vocab), shard_samples, cfg.shard_tokens)
    cfg.num_shards = len(plan)
    ds = Dataset.parse(name, "hidden", data_root)
    mine = [j for j in range(len(plan)) if j % workers == worker]
    todo = [j for j in mine if not (ds.path / shard_name(j)).exists()]
    sizes = {j: shard_layout(cfg, len(plan[j]), sum(r.n_tokens for r in plan[j])).size for j in todo}
    tokens = sum(r.n_tokens for j in todo for r in plan[j])
    free = _free_bytes(ds.path)
    who = f"worker {worker}/{workers}" if workers > 1 else ds.ref
    log(f"{who}: {len(mine) - len(todo)} of {len(mine)} shards already there ({len(plan)} in all), {len(todo)} to "
        f"extract from {sds.ref}: layers {layers} of {num_layers}, H {hidden}, aux {aux_dtype}, teacher {teacher}"
        f"{f' K={topk}' if teacher == 'topk' else ''}, {backend} backend on {dev}, {cfg.dtype}")
    log(f"disk bill: {bpt:,} B/token x {tokens:,} tokens = {sum(sizes.values()) / 1e9:.3f} GB with headers; "
        f"{free / 1e9:.2f} GB free on the volume of {ds.path}")
    placement = _place(cfg, model, devices, world, max_memory, tokens, quiet=rank != 0)
    if dry_run:
        enough = "enough" if sum(sizes.values()) <= free else "NOT enough (the run would be refused)"
        log(f"dry run: {enough} disk; nothing loaded or written")
        return {"plan": placement.to_dict(), "tokens": tokens, "bytes": sum(sizes.values()), "free_bytes": free}
    if sum(sizes.values()) > free:
        raise DatasetError(f"{ds.ref}: needs {sum(sizes.values()) / 1e9:.2f} GB but {free / 1e9:.2f} GB are free: "
                           f"free space, point EYAS_DATA at a larger volume, or shrink the layout "
                           f"(--aux-dtype fp8 and --teacher topk store about half as much)")

    manifest = _open_dataset(ds, cfg, sds, smanifest.get("target"), fingerprint)
    if manifest.get("status") == "complete":
        log(f"{ds.ref} is already complete")
        return manifest["stats"]
    for j in mine:  # temp files of this worker's shards, left by a killed run
        for tmp in ds.path.glob(f".{shard_name(j)}.tmp-*"):
            tmp.unlink()

    if world > 1:
        import datetime

        import torch.distributed as dist

        # gloo, only for the final barrier: ranks may end hours apart, past NCCL's default timeout.
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=7))

    try:
        stats = _extract(cfg, dev, ds, plan, todo, samples_path, tokens, progress) if todo else {"tokens": 0}
    except KeyboardInterrupt:
        kept = sum((ds.path / shard_name(j)).exists() for j in mine)
        log(f"interrupted: {kept} of {len(mine)} shards of this worker are saved in {ds.path}; "
            f"rerun the same command to resume")
        raise SystemExit(130) from None
    stats |= {"worker": worker, "workers": workers, "host": socket.gethostname(), "shards": len(todo),
              "wall_s": round(time.monotonic() - t_start, 2)}
    if todo:
        write_json_atomic(ds.path / RUNS / f"worker-{worker:03d}-of-{workers:03d}.json", stats)
        log(f"{who}: {stats['tokens']:,} tokens in {stats['compute_s']:.1f} s: {stats['tokens_per_s']:,.0f} tokens/s, "
            f"{bpt:,} B/token, {stats['pad_fraction']:.1%} padding; wall {stats['wall_s']:.1f} s")

    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return stats
    missing = [j for j in range(len(plan)) if not (ds.path / shard_name(j)).exists()]
    if missing:
        log(f"{ds.ref}: {len(plan) - len(missing)} of {len(plan)} shards there; the other --shard parts are still to "
            f"run (the last one to end finalizes, or run `eyas-extract finalize {ds.name}`)")
        return stats
    final = finalize_dataset(ds.name, data_root=data_root)
    return stats | {"dataset": final}


def _extract(cfg: ExtractConfig, dev: torch.device, ds: Dataset, plan: list, todo: list[int], samples_path: Path,
             tokens: int, progress: bool) -> dict[str, Any]:
    """Run the backend over this worker's pending shards; returns tokens, seconds and padding."""
    if cfg.backend == "vllm":
        from eyas_extract.vllm_backend import VLLMBackend

        backend: Any = VLLMBackend(cfg, max(r.n_tokens for j in todo for r in plan[j]))
    else:
        from eyas_extract.hf_backend import HFBackend

        backend = HFBackend(cfg, dev)
    bar = tqdm(total=tokens, unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True,
               desc=f"extract {ds.name}", smoothing=0.1)
    old_term = signal.signal(signal.SIGTERM, _interrupt)
    writer = Writer()
    shards: list[ShardWriter] = []
    done = padded = 0
    t0 = time.monotonic()
    try:
        for j in todo:
            refs = plan[j]
            seqs = load_tokens(samples_path, refs)
            ids = [s for s, _ in seqs]
            sw = ShardWriter(ds.path / shard_name(j), cfg, [r.id for r in refs], [len(s) for s in ids])
            shards.append(sw)
            sw.put("input_ids", 0, torch.tensor([t for s in ids for t in s], dtype=torch.int32))
            sw.put("loss_mask", 0, torch.tensor([m for _, mask in seqs for m in mask], dtype=torch.uint8))
            batches = make_batches([len(s) for s in ids], cfg.batch_tokens)
            padded += sum(len(b) * len(ids[b[0]]) for b in batches)  # vllm pads nothing: it packs
            for samples, rows in backend.extract(ids, batches):
                writer.submit(sw, samples, rows)
                n = sum(len(ids[k]) for k in samples)
                done += n
                bar.update(n)
            writer.put(sw.commit)
        writer.close()
        compute = time.monotonic() - t0  # not counting the backend's shutdown below
    except BaseException:
        bar.close()
        try:
            writer.close()  # shards whose last batch is queued are still committed
        except BaseException:  # noqa: BLE001 - the first error is the one to report
            pass
        for sw in shards:
            sw.abort()  # a no-op for committed shards: their temp file is gone
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
        bar.close()
        backend.close()
    return {"tokens": done, "compute_s": round(compute, 3), "tokens_per_s": round(done / compute, 1),
            "pad_fraction": round(1 - done / padded, 4) if padded and cfg.backend == "hf" else 0.0}


def finalize_dataset(name: str, *, data_root: Path | None = None) -> dict[str, Any]:
    """Check that every shard is there, merge the workers' stats and mark hidden/NAME complete."""
    ds = Dataset.parse(name, "hidden", data_root)
    manifest = ds.read_manifest()
    check_schema(ds, manifest)
    params = manifest["params"]
    n = params["num_shards"]
    missing = [j for j in range(n) if not (ds.path / shard_name(j)).exists()]
    if missing:
        raise DatasetError(f"{ds.ref}: shards {missing[:10]}{' ...' if len(missing) > 10 else ''} of {n} are missing; "
                           f"rerun {REMAKE['hidden']} with the same options (each --shard I/N part) to make them")
    samples = tokens = masked = size = 0
    records = {}
    for j in range(n):
        path = ds.path / shard_name(j)
        with safe_open(path, "pt") as f:
            offsets = f.get_tensor("offsets")
            masked += int(f.get_tensor("loss_mask").sum())
        samples += len(offsets) - 1
        tokens += int(offsets[-1])
        size += path.stat().st_size
        records[shard_name(j)] = len(offsets) - 1
    runs = [json.loads(p.read_text()) for p in sorted((ds.path / RUNS).glob("worker-*.json"))]
    compute = max((r.get("compute_s", 0) for r in runs), default=0)
    stats = {
        "samples": samples, "tokens": tokens, "masked_tokens": masked, "shards": n, "bytes": size,
        "bytes_per_token": round(size / tokens, 2),
        # All workers together, assuming they ran side by side: their tokens over the longest run.
        "tokens_per_s": round(sum(r.get("tokens", 0) for r in runs) / compute, 1) if compute else None,
        "wall_s": max((r.get("wall_s", 0) for r in runs), default=None),
        "workers": runs,
    }
    manifest = finalize(ds, manifest, stats=stats, records=records)
    log(f"{ds.ref} complete: {samples:,} samples, {tokens:,} tokens in {n} shards, {size / 1e9:.3f} GB "
        f"({stats['bytes_per_token']:,} B/token), {stats['tokens_per_s'] or 0:,.0f} tokens/s, wall {stats['wall_s']} s")
    return stats
