"""eyas-extract run: a synth dataset and its target -> EAGLE-3 hidden states in `hidden/NAME/`.

The files of a hidden dataset, and the shard layout, are owned by eyas_common.hidden.
Work is cut into shards from the synth dataset alone (batching.py), and shard j belongs to worker
j mod W, where W = (--shard parts) x (torchrun ranks). A rerun skips the shards already there and
redoes the rest (and a partial dataset's unreadable ones), so a killed run resumes by rerunning it.
The last worker to finish (or `eyas-extract finalize NAME`) checks that every shard is there, then
marks the dataset complete.
"""

from __future__ import annotations

import functools
import queue
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from eyas_common.chat import load_tokenizer, target_fingerprint
from eyas_common.checkpoint import CONFIG, read_checkpoint_size, read_text_config
from eyas_common.contract import (REMAKE, Dataset, DatasetError, await_start, check_intact, check_schema,
                                  check_target, describe_files, human_bytes, input_ref, open_input, open_output,
                                  temp_files)
from eyas_common.hidden import (ShardCounts, ShardWriter, bytes_per_token, count_shard, made_shards, manifest_mutex,
                                mark_budget_wait, missing_shards, read_runs, shard_layout, shard_name, shard_problem,
                                update_manifest, write_run)
from eyas_common.launch import INTERRUPTED
from eyas_common.lock import WORKER_PART, WriterLock, describe, holder, lock_parts, worker_part
from eyas_common.methods import default_layers
from eyas_common.procs import Ranks, sigterm_as_interrupt, torchrun_ranks
from eyas_common.samples import SAMPLES, index_samples, read_tokens, shortfall_note

from eyas_extract.batching import make_batches, plan_shards
from eyas_extract.config import AUX_DTYPES, BACKENDS, MAY_CHANGE, TEACHERS, ExtractConfig, ExtractOptions
from eyas_extract.follow import (ConsumerDone, Follower, check_shards, follow_started, list_shards, resume_terms,
                                 wait_for_budget)
from eyas_extract.hf_backend import check_device_map, pick_attn, pick_device, pick_dtype
from eyas_extract.placement import Devices, Plan, estimate_seconds, plan_placement, shard_work_note, tokens_note



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


def _model_dims(model: Path) -> tuple[int, int, int]:
    """Layers, width and vocabulary of the target's text model (nested in a wrapper's config)."""
    try:
        text = read_text_config(model)
        return int(text["num_hidden_layers"]), int(text["hidden_size"]), int(text["vocab_size"])
    except FileNotFoundError as e:
        raise DatasetError(str(e)) from None
    except (KeyError, TypeError, ValueError) as e:
        raise DatasetError(f"{model / CONFIG}: no usable {e} for the text model; --model must be a transformers "
                           f"checkpoint folder") from None


def _place(cfg: ExtractConfig, model: Path, devices: str | None, world: int, max_memory: dict[str, str] | None,
           tokens: int, *, quiet: bool, fresh_shards: int, disk_bytes: int) -> Plan:
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
        seconds = estimate_seconds(plan, size, found, tokens)
        log(f"estimated time: {tokens_note(tokens, seconds)}")
        if note := shard_work_note(seconds, fresh_shards, disk_bytes):  # a started dataset keeps its shards
            log(note)
    return plan


def _open_dataset(job: Job, *, allow_code_change: bool) -> dict[str, Any]:
    """The hidden manifest: new, or the existing one after checking it was made the same way (a complete one
    is returned as it is). Every check runs before the first write, so a refused rerun changes nothing."""
    ds = job.ds
    inputs, made_with = resume_terms(ds, job.sds, follow=job.follower is not None, num_shards=job.cfg.num_shards)
    manifest = open_output(ds, stage="02_extract", params=asdict(job.cfg), may_change=MAY_CHANGE,
                           target=job.smanifest.get("target"), inputs=inputs, made_with=made_with,
                           allow_code_change=allow_code_change, complete="keep",
                           fix="resume it with the same options (and the same synth dataset), or pick another --name")
    if manifest.get("status") == "complete":
        return manifest
    there: list[int] = []
    if made_with is not None:  # resumed on --follow's terms: the shards there must be the plan's
        there = check_shards(ds, job.sds.ref, job.plan)
        manifest["inputs"] = [input_ref(job.sds)]
    if job.follower is not None:
        ds.path.mkdir(parents=True, exist_ok=True)
        list_shards(ds, manifest, job.plan, there)
    elif job.todo or not ds.exists():
        ds.path.mkdir(parents=True, exist_ok=True)
        ds.write_manifest(manifest)
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


@dataclass
class Job:
    """What one extraction worker does: the config, where it reads and writes, and its shards."""

    cfg: ExtractConfig
    sds: Dataset                  # the input synth dataset
    smanifest: dict[str, Any]
    fingerprint: dict[str, Any]   # the loaded target's tokenizer and chat template
    ds: Dataset                   # the hidden dataset written
    dev: torch.device
    ranks: Ranks
    part: int                     # --shard I/N: this host's I and N
    parts: int
    plan: list = field(default_factory=list)    # every shard's samples (batching.plan_shards)
    todo: list[int] = field(default_factory=list)  # this worker's shards still to make
    follower: Follower | None = None  # --follow: synth as it is being written, and the shards it makes final
    disk_budget: int | None = None    # --follow --disk-budget: most bytes of shards not yet consumed by training
    consumer_grace: float = 600.0     # --disk-budget: seconds with no consumer alive before extract stops

    @property
    def workers(self) -> int:
        return self.parts * self.ranks.world

    @property
    def worker(self) -> int:
        # Host I of N keeps shards j = I mod N; its ranks split those further. Worker w takes j = w mod W.
        return self.part + self.parts * self.ranks.rank

    @property
    def mine(self) -> list[int]:
        return [j for j in range(len(self.plan)) if j % self.workers == self.worker]

    @property
    def who(self) -> str:
        return f"worker {self.worker}/{self.workers}" if self.workers > 1 else self.ds.ref


def run(options: ExtractOptions | None = None, *, data_root: Path | None = None, progress: bool = True,
        **fields: Any) -> dict[str, Any]:
    """Extract (or resume) hidden dataset `name` from synth dataset `synth`; returns this worker's stats.

    `options` as the CLI builds them, or their fields as keywords (ExtractOptions(**fields)).
    """
    opts = options if options is not None else ExtractOptions(**fields)
    t_start = time.monotonic()
    if opts.devices and not opts.dry_run:
        raise DatasetError(f"--devices {opts.devices!r} describes another machine: use it with --dry-run only")
    job = _plan(opts, data_root)
    size, tokens, free = _disk_bill(job)
    placement = _place(job.cfg, Path(opts.model), opts.devices, job.ranks.world, opts.max_memory, tokens,
                       quiet=job.ranks.rank != 0, disk_bytes=size,
                       fresh_shards=0 if job.follower or job.ds.exists() else len(job.todo))
    if opts.dry_run:
        log(f"dry run: {'enough' if size <= free else 'NOT enough (the run would be refused)'} disk; "
            f"nothing loaded or written")
        return {"plan": placement.to_dict(), "tokens": tokens, "bytes": size, "free_bytes": free}
    _refuse_full_disk(job.ds, size, free)
    # Each worker part has its own lock: two runs of one part are refused, different parts run side by side.
    with WriterLock(job.ds, stage="02_extract", part=worker_part(job.worker, job.workers)):
        _refuse_other_split(job)
        manifest = _open_dataset(job, allow_code_change=opts.allow_code_change)
        if manifest.get("status") == "complete":
            log(f"{job.ds.ref} is already complete")
            return manifest["stats"]
        for j in job.mine:  # temp files of this worker's shards, left by a killed run (the lock says it is gone)
            for tmp in temp_files(job.ds.path / shard_name(j)):
                tmp.unlink()
        stats = _work(job, manifest, progress, t_start)
    if job.ranks.world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
        if job.ranks.rank != 0:
            return stats
    if "stopped" in stats:  # --follow under a budget whose training run is over: nothing to finalize
        log(stats["stopped"])
        return stats
    missing = missing_shards(job.ds, len(job.plan))
    if missing:
        log(f"{job.ds.ref}: {len(job.plan) - len(missing)} of {len(job.plan)} shards there; the other --shard parts "
            f"are still to run (the last one to end finalizes, or run `eyas-extract finalize {job.ds.name}`)")
        return stats
    return stats | {"dataset": finalize_dataset(job.ds.name, data_root=data_root)}


def _refuse_other_split(job: Job) -> None:
    """The workers of one split (--shard I/N x torchrun ranks = worker W of N) run side by side, each under its
    own lock; a live worker of another split (another N) owns some of the same shards, so a run beside it would
    make them twice and clear its temp files as its own. Checked once this run holds its lock: of two runs
    started together, at least the second sees the first."""
    for part in lock_parts(job.ds):
        found = WORKER_PART.fullmatch(part)
        if not found or int(found[2]) == job.workers:
            continue
        if (other := holder(job.ds, part)) is not None:
            raise DatasetError(
                f"{job.ds.ref} is being written by {describe(other)} as {part} (its shards split over {found[2]} "
                f"worker(s): --shard parts x torchrun ranks); this run splits them over {job.workers}, so the two "
                f"would make the same shards: wait for it to end, or run this one with the same split")


def _plan(opts: ExtractOptions, data_root: Path | None) -> Job:
    """Check the options and the input, and cut the work into shards; writes nothing."""
    if opts.backend not in BACKENDS or opts.teacher not in TEACHERS or opts.aux_dtype not in AUX_DTYPES:
        raise DatasetError(f"backend {opts.backend!r}, teacher {opts.teacher!r}, aux dtype {opts.aux_dtype!r}: "
                           f"expected one of {BACKENDS}, {TEACHERS}, {AUX_DTYPES}")
    part, parts = parse_shard(opts.shard)
    ranks = torchrun_ranks()
    if opts.disk_budget and not opts.follow:
        raise DatasetError("--disk-budget waits for a training run to consume shards as they are made: add --follow")
    if opts.follow:
        _refuse_follow(opts, parts, ranks.world)
        await_start(opts.synth, "synth", root=data_root, poll_s=opts.poll_seconds, say=log)
    if ranks.world > 1 and (opts.backend == "vllm" or opts.device_map):
        raise DatasetError("under torchrun each rank runs its own copy of the target on its own GPU: --backend vllm "
                           "and --device-map need a process of their own; split hosts or GPUs with --shard I/N instead")
    if opts.backend == "vllm":
        from eyas_extract.vllm_backend import require_vllm

        require_vllm()
    model = Path(opts.model)
    sds, smanifest, fingerprint = _open_synth(opts.synth, model, opts.trust_remote_code, data_root,
                                              follow=opts.follow)
    if opts.follow and opts.backend == "vllm" and not _follow_max_len(smanifest):
        raise DatasetError(f"--follow --backend vllm sizes vLLM by the synth server's context, which {sds.ref} does "
                           f"not record (params.max_model_len); follow it with --backend hf")
    num_layers, hidden, vocab = _model_dims(model)
    # the layer ids are the dataset's record of what it holds (params.layers); the method only picks them
    layers = list(opts.layers) if opts.layers else default_layers(opts.method, num_layers)
    if len(set(layers)) != len(layers) or not all(0 <= k < num_layers for k in layers):
        raise DatasetError(f"--layers {layers}: need distinct ids in [0, {num_layers}) (id k is the state entering "
                           f"layer k; the target has {num_layers} layers, default for {opts.method} {default_layers(opts.method, num_layers)})")
    if opts.teacher == "topk" and not 1 <= opts.topk <= vocab:
        raise DatasetError(f"--topk {opts.topk}: need 1 <= K <= {vocab} (the target's vocabulary)")
    here = not opts.devices  # a dry run for another machine (--devices) does not check this one's GPUs
    dev = pick_device(opts.device, here=here)
    check_device_map(opts.device_map, here=here)
    if dev.type == "cuda" and ranks.world > 1:
        dev = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(dev)
    compute = pick_dtype(opts.dtype, dev)
    cfg = ExtractConfig(
        synth=sds.ref, model=str(model), backend=opts.backend, layers=layers, num_layers=num_layers,
        hidden_size=hidden, vocab_size=vocab, aux_dtype=opts.aux_dtype, teacher=opts.teacher,
        topk=opts.topk if opts.teacher == "topk" else 0, shard_samples=opts.shard_samples, shard_tokens=0,
        num_shards=0, batch_tokens=opts.batch_tokens, dtype=compute, attn=pick_attn(opts.attn, dev, compute),
        device_map=opts.device_map, trust_remote_code=opts.trust_remote_code)
    cfg.shard_tokens = max(1, opts.shard_mb * (1 << 20) // bytes_per_token(cfg))
    job = Job(cfg, sds, smanifest, fingerprint, Dataset.parse(opts.name, "hidden", data_root), dev, ranks, part, parts,
              disk_budget=opts.disk_budget, consumer_grace=opts.consumer_grace)
    _cut(job, follow=opts.follow, poll_s=opts.poll_seconds)
    return job


def _refuse_follow(opts: ExtractOptions, parts: int, world: int) -> None:
    """--follow runs as one process: it alone writes the manifest's list of final shards."""
    if parts > 1 or world > 1:
        why = f"--shard {opts.shard}" if parts > 1 else f"torchrun ({world} ranks)"
        raise DatasetError(f"--follow runs as one worker, the one writer of the manifest's shard list: run it "
                           f"without {why}")
    if opts.poll_seconds <= 0:
        raise DatasetError(f"--poll-seconds {opts.poll_seconds}: must be above 0")


def _cut(job: Job, *, follow: bool, poll_s: float) -> None:
    """The shard plan: every shard of the synth dataset; with --follow, those final so far (the plan grows, and
    the shard count, params.num_shards, stays 0 until synth is complete)."""
    cfg, sds = job.cfg, job.sds
    if follow:
        job.follower = Follower(sds, vocab_size=cfg.vocab_size, shard_samples=cfg.shard_samples,
                                shard_tokens=cfg.shard_tokens, poll_s=poll_s)
        job.plan = job.follower.new_shards()
    else:
        index = index_samples(sds.path / SAMPLES, cfg.vocab_size) if (sds.path / SAMPLES).exists() else []
        if not index:
            raise DatasetError(f"{sds.ref} holds no samples ({SAMPLES} is empty or missing): nothing to extract; "
                               f"remake it with {REMAKE['synth']}")
        job.plan = plan_shards(index, cfg.shard_samples, cfg.shard_tokens)
        cfg.num_shards = len(job.plan)
    made = made_shards(job.ds)
    job.todo = [j for j in job.mine if shard_name(j) not in made]
    if job.follower is None:
        job.todo = sorted(job.todo + _unreadable(job, made))


def _unreadable(job: Job, made: set[str]) -> list[int]:
    """This worker's shards of a partial dataset whose file cannot be read (cut short by a full disk, a copy,
    a hand): not written, so extracted again, the new file replacing the broken one only once it is whole.

    Never in a complete dataset (its shards are its record), nor a shard the manifest lists (--follow lists
    each final shard for a training run to take as it is): those are refused when read, naming the fix."""
    ds = job.ds
    manifest = ds.read_manifest() if ds.exists() else {}
    if not manifest or manifest.get("status") == "complete" or follow_started(manifest):
        return []
    listed = {e.get("name") for e in manifest.get("files") or []}
    redo = []
    for j in (j for j in job.mine if shard_name(j) in made and shard_name(j) not in listed):
        path = ds.path / shard_name(j)
        if path.exists() and (why := shard_problem(path)):
            log(f"{ds.ref}: {path} is not a readable safetensors file ({why}): extracting that shard again")
            redo.append(j)
    return redo


def _open_synth(synth: str, model: Path, trust_remote_code: bool, data_root: Path | None, *, follow: bool
                ) -> tuple[Dataset, dict[str, Any], dict[str, Any]]:
    """The input, refused when partial (unless followed), corrupted, unknown or made for another tokenizer."""
    sds, smanifest = open_input(synth, "synth", root=data_root, allow_partial=follow)
    if smanifest.get("status") == "complete":  # a partial one lists no files yet: checked once complete
        check_intact(sds, smanifest)
    fingerprint = target_fingerprint(load_tokenizer(model, trust_remote_code), model)
    check_target(sds, smanifest, fingerprint)
    if shortfall := shortfall_note(smanifest):
        log(f"{sds.ref}: {shortfall}")
    return sds, smanifest, fingerprint


def _disk_bill(job: Job) -> tuple[int, int, int]:
    """Print and return the disk bill of this worker's shards: (bytes, tokens, free bytes on the volume)."""
    cfg, ds = job.cfg, job.ds
    bpt = bytes_per_token(cfg)
    size = sum(shard_layout(cfg, len(job.plan[j]), sum(r.n_tokens for r in job.plan[j])).size for j in job.todo)
    tokens = sum(r.n_tokens for j in job.todo for r in job.plan[j])
    free = _free_bytes(ds.path)
    log(f"{job.who}: {len(job.mine) - len(job.todo)} of {len(job.mine)} shards already there ({len(job.plan)} "
        f"{'final so far' if job.follower else 'in all'}), {len(job.todo)} to extract from {job.sds.ref}: "
        f"layers {cfg.layers} of {cfg.num_layers}, H {cfg.hidden_size}, aux {cfg.aux_dtype}, teacher {cfg.teacher}"
        f"{f' K={cfg.topk}' if cfg.teacher == 'topk' else ''}, {cfg.backend} backend on {job.dev}, {cfg.dtype}")
    log(f"disk bill: {bpt:,} B/token x {tokens:,} tokens = {human_bytes(size)} with headers; "
        f"{human_bytes(free)} free on the volume of {ds.path}")
    return size, tokens, free


def _refuse_full_disk(ds: Dataset, size: int, free: int) -> None:
    if size > free:
        raise DatasetError(f"{ds.ref}: needs {human_bytes(size)} but {human_bytes(free)} are free: "
                           f"free space, point EYAS_DATA at a larger volume, or shrink the layout "
                           f"(--aux-dtype fp8 and --teacher topk store about half as much)")


def _work(job: Job, manifest: dict[str, Any], progress: bool, t_start: float) -> dict[str, Any]:
    """Extract this worker's pending shards (with --follow: until synth is complete) and record its run;
    Ctrl-C / SIGTERM keep the finished shards."""
    if job.ranks.world > 1:
        import datetime

        import torch.distributed as dist

        # gloo, only for the final barrier: ranks may end hours apart, past NCCL's default timeout.
        dist.init_process_group("gloo", timeout=datetime.timedelta(days=7))
    ds, samples_path = job.ds, job.sds.path / SAMPLES
    try:
        with sigterm_as_interrupt():
            if job.follower is not None:
                stats = _follow(job, manifest, progress)
            else:
                stats = _extract(job.cfg, job.dev, ds, job.plan, job.todo, samples_path, progress) \
                    if job.todo else {"tokens": 0}
    except KeyboardInterrupt:
        kept = sum((ds.path / shard_name(j)).exists() for j in job.mine)
        log(f"interrupted: {kept} of {len(job.mine)} shards of this worker are saved in {ds.path}; "
            f"rerun the same command to resume")
        raise SystemExit(INTERRUPTED) from None
    stats |= {"worker": job.worker, "workers": job.workers, "host": socket.gethostname(), "shards": len(job.todo),
              "wall_s": round(time.monotonic() - t_start, 2)}
    if job.todo:
        write_run(ds, job.worker, job.workers, stats)
        log(f"{job.who}: {stats['tokens']:,} tokens in {stats['compute_s']:.1f} s: {stats['tokens_per_s']:,.0f} "
            f"tokens/s, {bytes_per_token(job.cfg):,} B/token, {stats['pad_fraction']:.1%} padding; "
            f"wall {stats['wall_s']:.1f} s")
    return stats


def _follow(job: Job, manifest: dict[str, Any], progress: bool) -> dict[str, Any]:
    """--follow: extract the shards final now, then each one as synth makes it final, listing each in the
    manifest once committed; when synth is complete, record the shard count and the input as they end."""
    ds, follower = job.ds, job.follower
    assert follower is not None

    def listed(j: int) -> None:
        list_shards(ds, manifest, job.plan, [j])

    mark_budget_wait(ds, manifest, None)  # a killed run's wait (its budget may have been changed since)

    with Extraction(job.cfg, job.dev, ds, job.sds.path / SAMPLES, max_len=_follow_max_len(job.smanifest),
                    progress=progress) as ex:
        def budgeted(todo: list[int]) -> None:
            if not job.disk_budget:
                ex.shards(job.plan, todo, then=listed)
                return
            for j in todo:  # one at a time, each once the budget has room for it
                size = shard_layout(job.cfg, len(job.plan[j]), sum(r.n_tokens for r in job.plan[j])).size
                wait_for_budget(ds, manifest, job.disk_budget, j, size, poll_s=follower.poll_s, say=log,
                                grace_s=job.consumer_grace)
                ex.shards(job.plan, [j], then=listed)

        def extract(todo: list[int]) -> None:
            job.todo += todo
            budgeted(todo)

        try:
            budgeted(job.todo)
            follower.run(job.plan, extract, ds=ds, say=log)
        except ConsumerDone as done:
            return ex.finish() | {"stopped": (
                f"{ds.ref}: stopping before {shard_name(done.shard)}: {done.draft}, the training run that consumes "
                f"it, is complete and reads or deletes no more shards (it ended before the data: an early stop or "
                f"a shorter schedule). {ds.ref} stays partial, for {done.draft} alone; {job.sds.ref} keeps every "
                f"sample (extract it under another --name for another run)")}
        stats = ex.finish()
    check_intact(job.sds, job.sds.read_manifest())  # complete now: its files must be its manifest's, as for any run
    job.cfg.num_shards = manifest["params"]["num_shards"] = len(job.plan)
    manifest["inputs"] = [input_ref(job.sds)]
    update_manifest(ds, manifest)
    return stats


def _follow_max_len(smanifest: dict[str, Any]) -> int:
    """The longest sample a --follow run may meet (the vllm backend sizes its engine by it): the synth server's
    context, as synth recorded it; 0 when unknown (only the hf backend can follow then)."""
    return int((smanifest.get("params") or {}).get("max_model_len") or 0)


def _extract(cfg: ExtractConfig, dev: torch.device, ds: Dataset, plan: list, todo: list[int], samples_path: Path,
             progress: bool) -> dict[str, Any]:
    """Run the backend over this worker's pending shards; returns tokens, seconds and padding."""
    longest = max(r.n_tokens for j in todo for r in plan[j])
    with Extraction(cfg, dev, ds, samples_path, max_len=longest, progress=progress) as ex:
        ex.shards(plan, todo)
        return ex.finish()


class Extraction:
    """One backend and one writer thread over shards given at once, or as they become final (--follow).

    Used with `with`: on an error or an interrupt the shards already queued are still committed, the
    others' temp files are removed, and the backend is closed.
    """

    def __init__(self, cfg: ExtractConfig, dev: torch.device, ds: Dataset, samples_path: Path, *, max_len: int,
                 progress: bool):
        self.cfg, self.ds, self.samples_path = cfg, ds, samples_path
        if cfg.backend == "vllm":
            from eyas_extract.vllm_backend import VLLMBackend

            self.backend: Any = VLLMBackend(cfg, max_len)
        else:
            from eyas_extract.hf_backend import HFBackend

            self.backend = HFBackend(cfg, dev)
        self.bar = tqdm(total=0, unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True,
                        desc=f"extract {ds.name}", smoothing=0.1)
        self.writer = Writer()
        self.started: list[ShardWriter] = []
        self.done = self.padded = 0
        self.busy_s = 0.0  # time spent extracting, not waiting for synth

    def shards(self, plan: list, todo: list[int], *, then: Callable[[int], None] | None = None) -> None:
        """Extract shards `todo` of `plan`; `then(j)` runs on the writer thread once shard j is committed."""
        t0 = time.monotonic()
        cfg = self.cfg
        self.bar.total += sum(r.n_tokens for j in todo for r in plan[j])
        self.bar.refresh()
        for j in todo:
            refs = plan[j]
            seqs = read_tokens(self.samples_path, refs)
            ids = [s for s, _ in seqs]
            sw = ShardWriter(self.ds.path / shard_name(j), cfg, [r.id for r in refs], [len(s) for s in ids])
            self.started.append(sw)
            sw.put("input_ids", 0, torch.tensor([t for s in ids for t in s], dtype=torch.int32))
            sw.put("loss_mask", 0, torch.tensor([m for _, mask in seqs for m in mask], dtype=torch.uint8))
            batches = make_batches([len(s) for s in ids], cfg.batch_tokens)
            self.padded += sum(len(b) * len(ids[b[0]]) for b in batches)  # vllm pads nothing: it packs
            for samples, rows in self.backend.extract(ids, batches):
                self.writer.submit(sw, samples, rows)
                n = sum(len(ids[k]) for k in samples)
                self.done += n
                self.bar.update(n)
            self.writer.put(sw.commit)
            if then is not None:
                self.writer.put(functools.partial(then, j))
        self.busy_s += time.monotonic() - t0

    def finish(self) -> dict[str, Any]:
        """Wait for every queued write; tokens, seconds and padding of the shards extracted."""
        t0 = time.monotonic()
        self.writer.close()
        compute = self.busy_s + time.monotonic() - t0  # not counting the backend's shutdown
        done, padded = self.done, self.padded
        return {"tokens": done, "compute_s": round(compute, 3),
                "tokens_per_s": round(done / compute, 1) if compute else 0.0,
                "pad_fraction": round(1 - done / padded, 4) if padded and self.cfg.backend == "hf" else 0.0}

    def __enter__(self) -> "Extraction":
        return self

    def __exit__(self, error: type[BaseException] | None, *rest: Any) -> None:
        self.bar.close()
        try:
            if error is not None:
                try:
                    self.writer.close()  # shards whose last batch is queued are still committed
                except BaseException:  # noqa: BLE001 - the first error is the one to report
                    pass
                for sw in self.started:
                    sw.abort()  # a no-op for committed shards: their temp file is gone
        finally:
            self.backend.close()


def _counts(ds: Dataset, manifest: dict[str, Any], j: int) -> ShardCounts:
    """Shard j's counts: read from the shard, or from its entry when a training run consumed it."""
    entry = next((e for e in manifest.get("files") or [] if e["name"] == shard_name(j)), {})
    if "consumed" not in entry:
        return count_shard(ds, j)
    return ShardCounts(entry["records"], entry["tokens"], entry["masked_tokens"], entry["bytes"])


def finalize_dataset(name: str, *, data_root: Path | None = None) -> dict[str, Any]:
    """Check that every shard is there, merge the workers' stats and mark hidden/NAME complete. Under the
    manifest's mutex: a training run consuming shards (--consume) waits, and its marks are kept."""
    ds = Dataset.parse(name, "hidden", data_root)
    _finalizable(ds, ds.read_manifest())  # before the mutex, whose file would be made beside a dataset not there
    with manifest_mutex(ds):
        manifest = ds.read_manifest()
        if not _finalizable(ds, manifest):
            log(f"{ds.ref} is already complete: nothing to do")
            return manifest["stats"]
        n = manifest["params"]["num_shards"]
        missing = missing_shards(ds, n)
        if missing:
            raise DatasetError(f"{ds.ref}: shards {missing[:10]}{' ...' if len(missing) > 10 else ''} of {n} are "
                               f"missing; rerun {REMAKE['hidden']} with the same options (each --shard I/N part) to "
                               f"make them")
        counts = [_counts(ds, manifest, j) for j in range(n)]
        stats = _final_stats(counts, read_runs(ds))
        consumed = [e for e in manifest.get("files") or [] if "consumed" in e]
        files = describe_files(ds, {shard_name(j): c.samples for j, c in enumerate(counts)}) + consumed
        manifest |= {"files": sorted(files, key=lambda e: e["name"]), "stats": stats, "status": "complete"}
        ds.write_manifest(manifest)
        # a writer killed while writing the manifest left its temp; a live one holds this mutex while it has one
        for tmp in temp_files(ds.manifest_path):
            tmp.unlink(missing_ok=True)
    log(f"{ds.ref} complete: {stats['samples']:,} samples, {stats['tokens']:,} tokens in {n} shards, "
        f"{stats['bytes'] / 1e9:.3f} GB ({stats['bytes_per_token']:,} B/token), {stats['tokens_per_s'] or 0:,.0f} "
        f"tokens/s, wall {stats['wall_s']} s")
    return stats


def _finalizable(ds: Dataset, manifest: dict[str, Any]) -> bool:
    """Whether `ds` is a partial hidden dataset whose shard count is known; False when it is complete (its
    files and stats are its record: finalizing again would hash what is there now, a changed or stray file
    included). Refused when made by --follow from a synth dataset not complete yet (no shard count yet)."""
    check_schema(ds, manifest)
    if manifest.get("status") == "complete":
        return False
    if follow_started(manifest):
        synth = (manifest.get("params") or {}).get("synth", "its synth dataset")
        raise DatasetError(f"{ds.ref} is extracted with --follow while {synth} is written, and has no shard count "
                           f"until {synth} is complete: finish {synth} (rerun its eyas-synth command), then rerun "
                           f"the eyas-extract run of {ds.ref}, which finalizes it")
    return True


def _final_stats(counts: list[ShardCounts], runs: list[dict[str, Any]]) -> dict[str, Any]:
    tokens, size = sum(c.tokens for c in counts), sum(c.bytes for c in counts)
    compute = max((r.get("compute_s", 0) for r in runs), default=0)
    return {
        "samples": sum(c.samples for c in counts), "tokens": tokens,
        "masked_tokens": sum(c.masked_tokens for c in counts), "shards": len(counts), "bytes": size,
        "bytes_per_token": round(size / tokens, 2),
        # All workers together, assuming they ran side by side: their tokens over the longest run.
        "tokens_per_s": round(sum(r.get("tokens", 0) for r in runs) / compute, 1) if compute else None,
        "wall_s": max((r.get("wall_s", 0) for r in runs), default=None),
        "workers": runs,
    }
