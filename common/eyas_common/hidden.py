"""The hidden dataset (stage 02 writes it, stage 03 reads it): file names, dtypes, writer, reader, checks.

This module is the one owner of the format; extract and train import it (it needs torch, which
stages 02 and 03 have). `hidden/NAME/` holds:
    shard-{i:05d}.safetensors   i in [0, params.num_shards); a final name appears only by atomic rename
    runs/worker-W-of-N.json     each extraction worker's last run: tokens, seconds (merged into stats)
    manifest.json               eyas.hidden/1; params = the extraction config; files = every file above
Shard i holds, for its S samples (ascending sample id) and their T tokens in total:
    aux            [T, n_aux*H]  the aux layers' states, concatenated in `params.layers` order;
                                 bf16 (default), fp32, or float8_e4m3fn with
    aux_scale      [T, n_aux]    float32, fp8 only: x ~= aux.view(T, n_aux, H).float() * aux_scale[..., None]
    final          [T, H]        the final normed hidden state (input of lm_head); bf16, fp32 with
                                 aux_dtype fp32; absent with teacher topk, which stores instead
    topk_ids       [T, K]        int32, and
    topk_logprobs  [T, K]        float32: log-softmax over the full target vocab, top K, sorted descending
    input_ids      [T]           int32, the synth sample's tokens
    loss_mask      [T]           uint8, 1 on the completion
    offsets        [S+1]         int64: sample j is rows offsets[j]:offsets[j+1]
    sample_ids     [S]           int64, the synth sample ids
Row t of a sample holds the states computed at position t (they predict token t+1); nothing is shifted.

Writing (stage 02): `ShardWriter` fills a shard of known layout and renames it into place, `write_run`
records a worker's run; finalizing reads them back with `missing_shards`, `count_shard` and `read_runs`.
Consuming (stage 03 `--consume`): `consume` deletes a shard a training run has used for the last time
and marks its `files` entry `"consumed": {"by": "drafts/NAME", "step": S}`. Extract and train write the
manifest at the same time then, so both write it through `update_manifest` (a mutex beside the dataset;
consumed marks are carried over). A dataset with consumed shards is read by its consumer alone.
While `eyas-extract run --follow --disk-budget` waits for room, the manifest says so (`budget_wait`: the
budget, the next shard and its bytes, the waiting process), so that a training run that can free nothing
before that shard arrives knows the two wait on each other and stops instead of waiting for ever.
Reading: `open_hidden(ref)` refuses a partial, unknown or missing dataset, then `HiddenShards` opens
exactly the shards the manifest lists, after checking each one's size (and sha256 when the dataset is
small enough to hash quickly) and that no unlisted file sits in the folder. Handles are opened
lazily and dropped on pickling, so the reader can go to DataLoader workers.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas_common.contract import (MANIFEST, REMAKE, Dataset, DatasetError, commit_temp, is_temp, lock_file,
                                  now_iso, open_input,
                                  raise_write_error, remake_fix, sha256_file, temp_path, temp_target,
                                  write_json_atomic)
from eyas_common.lock import WriterLock, any_holder, holder

FORMAT = "eyas.hidden/1"
RUNS = "runs"
# The one map from the dtype names eyas's options and manifests use to torch dtypes.
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
# Torch's own spellings, as ExtractConfig.dtype and HF configs write them.
_LONG = {"bfloat16": "bf16", "float32": "fp32", "float8_e4m3fn": "fp8"}
# Hash the shards before training only up to this many bytes in all (hashing runs at ~1 GB/s).
HASH_LIMIT_BYTES = 2 << 30
# safetensors' names for the dtypes a shard uses.
_ST_NAME = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def torch_dtype(name: str) -> torch.dtype:
    """bf16 / fp32 / fp8, or torch's own names for them."""
    return DTYPES[_LONG.get(name, name)]


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def runs_file(worker: int, workers: int) -> str:
    return f"{RUNS}/worker-{worker:03d}-of-{workers:03d}.json"


def write_run(ds: Dataset, worker: int, workers: int, stats: dict[str, Any]) -> None:
    """Record one extraction worker's last run (tokens, seconds, host), replacing its previous record."""
    write_json_atomic(ds.path / runs_file(worker, workers), stats)


def read_runs(ds: Dataset) -> list[dict[str, Any]]:
    """Every worker's last run, in worker order."""
    return [json.loads(p.read_text()) for p in sorted((ds.path / RUNS).glob("worker-*-of-*.json"))]


BUDGET_WAIT = "budget_wait"  # manifest key, present while extract waits for room under its --disk-budget
CONSUMED = "consumed"  # the mark on a `files` entry whose shard a training run deleted after its last use
SIZE_UNITS = {"T": 10**12, "G": 10**9, "M": 10**6, "K": 10**3, "": 1}  # decimal, as disks are sold
BINARY_UNITS = {"TI": 2**40, "GI": 2**30, "MI": 2**20, "KI": 2**10}  # GiB and kin, as df -h and RAM count


def parse_size(text: str) -> int:
    """Bytes of a --disk-budget value: 50G, 500M, 2T, 1.5GB, 40GiB or a plain number (G = 10^9 bytes, Gi =
    2^30). ValueError names what was expected."""
    body = str(text).strip().upper().removesuffix("B")
    unit = next((u for u in BINARY_UNITS if body.endswith(u)), body[-1:] if body[-1:] in SIZE_UNITS else "")
    try:
        return int(float(body[: len(body) - len(unit)]) * (BINARY_UNITS.get(unit) or SIZE_UNITS[unit]))
    except (ValueError, OverflowError):  # OverflowError: inf, or a number too large for a float (1e400)
        raise ValueError(f"{text!r} is not a size: expected e.g. 50G, 500M, 2T, 40GiB or a number of bytes") from None


def size_text(n: float) -> str:
    """n bytes as a --disk-budget value no smaller than n, to three significant digits: 313K, 1.25G."""
    unit, size = next((u, s) for u, s in SIZE_UNITS.items() if n >= s or s == 1)
    scale = 10 ** (2 - int(math.log10(max(n / size, 1))))  # 1 <= n / size < 1000: keep three digits
    return f"{math.ceil(n / size * scale) / scale:g}{unit}"


def consumed_marks(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shard name -> {"by": draft ref, "step": optimiser step} of every consumed shard."""
    return {e["name"]: e[CONSUMED] for e in manifest.get("files") or [] if CONSUMED in e}


@contextmanager
def manifest_mutex(ds: Dataset) -> Iterator[None]:
    # Beside the dataset (its folder holds only data), and not named *.lock: it is not a writer lock.
    path = ds.root / ds.kind / f".{ds.name}.manifest-mutex"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def update_manifest(ds: Dataset, manifest: dict[str, Any]) -> None:
    """Write the hidden manifest, keeping every consumed mark the one on disk has (a training run may have
    consumed shards since `manifest` was read): a consumed entry is kept even when its file is gone."""
    with manifest_mutex(ds):
        _write_with_marks(ds, manifest)


def _write_with_marks(ds: Dataset, manifest: dict[str, Any]) -> None:
    marks = consumed_marks(ds.read_manifest()) if ds.manifest_path.exists() else {}
    on_disk = {e["name"]: e for e in ds.read_manifest().get("files") or []} if marks else {}
    files = {e["name"]: e for e in manifest.get("files") or []}
    for name, mark in marks.items():
        files[name] = {**files.get(name, on_disk[name]), CONSUMED: mark}
    manifest["files"] = [files[name] for name in sorted(files)]
    ds.write_manifest(manifest)


def consume(ds: Dataset, names: list[str], *, by: str, step: int) -> None:
    """Mark shards consumed by `by` at `step`, then delete them (a kill between the two leaves a marked shard
    whose file the next call deletes)."""
    with manifest_mutex(ds):
        manifest = ds.read_manifest()
        for e in manifest.get("files") or []:
            if e["name"] in names and CONSUMED not in e:
                e[CONSUMED] = {"by": by, "step": step}
        ds.write_manifest(manifest)
    for name in names:
        (ds.path / name).unlink(missing_ok=True)


def shard_bytes(ds: Dataset) -> int:
    """Bytes of hidden shards on disk now: final ones, consumed ones not yet deleted, and ones being written
    (their temps have their final size from the start). The disk, not the manifest: a shard is written in the
    background and listed after its rename, so the manifest runs behind it."""
    sizes: dict[str, int] = {}  # by final name: a shard renamed while the folder is read counts once
    for p in ds.path.iterdir() if ds.path.is_dir() else []:
        if p.name.startswith("shard-"):
            name = p.name
        elif p.name.startswith(".shard-") and is_temp(p):
            name = temp_target(p).name
        else:
            continue
        # A temp renamed since the listing is its final file now (the writer thread commits while the main
        # thread weighs the next shard): counting it as gone would let one shard too many under the budget.
        for path in (p, ds.path / name):
            try:
                sizes[name] = path.stat().st_size
                break
            except FileNotFoundError:  # deleted by --consume
                continue
    return sum(sizes.values())


def mark_budget_wait(ds: Dataset, manifest: dict[str, Any], wait: dict[str, Any] | None) -> None:
    """Record that the writer waits for room under its disk budget (`wait`: budget, shard index, bytes, pid, host),
    or that it does not (None; written only when the manifest said it did)."""
    if wait is None and BUDGET_WAIT not in manifest:
        return
    with manifest_mutex(ds):  # the extract's shard writer thread writes `manifest` too, under the mutex
        if wait is None:
            del manifest[BUDGET_WAIT]
        else:
            manifest[BUDGET_WAIT] = wait
        _write_with_marks(ds, manifest)


def budget_wait(manifest: dict[str, Any], writer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The wait `mark_budget_wait` recorded, if the process that recorded it still holds the writer lock (a
    killed writer's mark is stale; its rerun clears it). The shards before the one it waits for are made or
    being made, though perhaps not listed yet: they are written in the background, one by one."""
    wait = manifest.get(BUDGET_WAIT)
    if not wait or not writer or (wait.get("pid"), wait.get("host")) != (writer.get("pid"), writer.get("host")):
        return None
    return wait


# The consumer lock: a training run with --consume holds `<root>/hidden/.<name>.consumer.lock` (lock.WriterLock,
# part "consumer") for as long as it runs, and records its last error beside it, in `.<name>.consumer.error`
# (JSON: by, error, at): a writer waiting under --disk-budget tells a live consumer from none, and says why.
CONSUMER_PART = "consumer"


def _consumer_error_file(ds: Dataset) -> Path:
    return lock_file(ds, CONSUMER_PART).with_suffix(".error")


@contextmanager
def consuming(ds: Dataset, *, by: str) -> Iterator[None]:
    """Hold the consumer lock of `ds` while draft `by` consumes it; the error the run stops with, if any, is
    recorded (consumer_error) for the writer that waits on it. A clean end, or a new run, clears it."""
    with WriterLock(ds, stage=f"03_train --consume ({by})", part=CONSUMER_PART):
        _consumer_error_file(ds).unlink(missing_ok=True)
        try:
            yield
        except BaseException as e:
            text = getattr(e, "line", None) or f"{type(e).__name__}: {e}".strip()
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                text = f"{by} was stopped ({type(e).__name__})"
            path = _consumer_error_file(ds)
            tmp = path.with_suffix(".error.tmp")
            tmp.write_text(json.dumps({"by": by, "error": text.splitlines()[0][:300] if text else "",
                                       "at": now_iso()}) + "\n")
            os.replace(tmp, path)
            raise


def consumer_alive(ds: Dataset) -> dict[str, Any] | None:
    """The training run holding the consumer lock of `ds` now (its lock record), or None."""
    return holder(ds, CONSUMER_PART)


def consumer_error(ds: Dataset) -> dict[str, Any] | None:
    """The last error a consuming training run recorded (by, error, at), or None."""
    try:
        return json.loads(_consumer_error_file(ds).read_text())
    except (OSError, ValueError):
        return None


def finished_consumer(ds: Dataset) -> str | None:
    """The draft that consumed `ds`, once complete: its run reads no more shards (it deletes, as it ends, every
    one listed), so a writer waiting under a disk budget has nobody left to wait for."""
    by = {m.get("by") for m in consumed_marks(ds.read_manifest()).values()}
    if len(by) != 1:
        return None
    draft = Dataset.parse(str(by.pop()), "drafts", ds.root)
    if not draft.manifest_path.exists():
        return None
    return draft.ref if draft.read_manifest().get("status") == "complete" else None


def refuse_consumed(ds: Dataset, manifest: dict[str, Any], consumer: str | None) -> dict[str, dict[str, Any]]:
    """The consumed marks, after refusing a reader other than the draft that consumed them."""
    marks = consumed_marks(manifest)
    by = {m.get("by") for m in marks.values()}
    if marks and by != {consumer}:
        name, mark = next(iter(marks.items()))
        raise DatasetError(f"{ds.ref} was consumed by {', '.join(sorted(map(str, by)))} ({len(marks)} shards deleted "
                           f"after their last use, {name} at step {mark.get('step')}); only that draft's run reads it "
                           f"(to resume). Remake it with {REMAKE['hidden']} under another name to train on it again")
    return marks


def made_shards(ds: Dataset) -> set[str]:
    """The names of the shards made so far: final files, and shards consumed since they were made."""
    marks = consumed_marks(ds.read_manifest()) if ds.manifest_path.exists() else {}
    return {p.name for p in ds.path.glob("shard-*.safetensors")} | set(marks)


def missing_shards(ds: Dataset, num_shards: int) -> list[int]:
    """The shard indices of [0, num_shards) not made yet."""
    made = made_shards(ds)
    return [j for j in range(num_shards) if shard_name(j) not in made]


def row_tensors(cfg: Any) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The per-token tensors of a shard: name -> (dtype, shape of one row). `cfg`: the extraction config."""
    n, h = len(cfg.layers), cfg.hidden_size
    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {"aux": (DTYPES[cfg.aux_dtype], (n * h,))}
    if cfg.aux_dtype == "fp8":
        out["aux_scale"] = (torch.float32, (n,))
    if cfg.teacher == "final":
        out["final"] = (DTYPES[cfg.stored_dtype], (h,))
    else:
        out["topk_ids"] = (torch.int32, (cfg.topk,))
        out["topk_logprobs"] = (torch.float32, (cfg.topk,))
    out["input_ids"] = (torch.int32, ())
    out["loss_mask"] = (torch.uint8, ())
    return out


def bytes_per_token(cfg: Any) -> int:
    return sum(dt.itemsize * math.prod(shape) for dt, shape in row_tensors(cfg).values())


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one shard lies; the file's size is known before anything is computed."""

    header: bytes                       # 8-byte length + JSON header, padded to 8 bytes
    spans: dict[str, tuple[int, int]]   # name -> (start, bytes per row) in the file
    size: int                           # file bytes


def shard_layout(cfg: Any, n_samples: int, n_tokens: int) -> Layout:
    shapes = {name: (dt, (n_tokens, *row)) for name, (dt, row) in row_tensors(cfg).items()}
    shapes["offsets"] = (torch.int64, (n_samples + 1,))
    shapes["sample_ids"] = (torch.int64, (n_samples,))
    # Widest dtype first, so every tensor starts aligned to its item size (zero-copy mmap reads).
    order = sorted(shapes, key=lambda k: (-shapes[k][0].itemsize, k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "schema": FORMAT}}
    pos, rows = 0, {}
    for name in order:
        dt, shape = shapes[name]
        nbytes = dt.itemsize * math.prod(shape)
        header[name] = {"dtype": _ST_NAME[dt], "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        rows[name] = (pos, dt.itemsize * math.prod(shape[1:]))
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    blob += b" " * (-len(blob) % 8)
    head = len(blob).to_bytes(8, "little") + blob
    return Layout(head, {k: (len(head) + start, rb) for k, (start, rb) in rows.items()}, len(head) + pos)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


class ShardWriter:
    """Writes one shard into a temp file of its final size, row ranges in any order; `commit` renames it.

    Rows land with pwrite at their known offsets, so the batches (sorted by length) can be written
    as they come without holding the shard in memory.
    """

    def __init__(self, path: Path, cfg: Any, sample_ids: list[int], lengths: list[int]):
        self.path = Path(path)
        self.tmp = temp_path(self.path)
        self.starts = [0]
        for n in lengths:
            self.starts.append(self.starts[-1] + n)
        self.layout = shard_layout(cfg, len(lengths), self.starts[-1])
        self._todo = set(range(len(lengths)))
        self.fd = os.open(self.tmp, os.O_CREAT | os.O_TRUNC | os.O_RDWR, 0o644)
        try:
            # Reserve the blocks now: a full disk fails here, not after an hour of compute.
            os.posix_fallocate(self.fd, 0, self.layout.size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                self.abort()
                raise_write_error(self.path, e)
            os.ftruncate(self.fd, self.layout.size)
        self._pwrite(self.layout.header, 0)
        self.put("offsets", 0, torch.tensor(self.starts, dtype=torch.int64))
        self.put("sample_ids", 0, torch.tensor(sample_ids, dtype=torch.int64))

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        view = memoryview(data)
        while view:
            try:
                n = os.pwrite(self.fd, view, offset)
            except OSError as e:
                raise_write_error(self.path, e)
            view, offset = view[n:], offset + n

    def put(self, name: str, row: int, t: torch.Tensor) -> None:
        start, row_bytes = self.layout.spans[name]
        self._pwrite(_bytes(t), start + row * row_bytes)

    def put_sample(self, k: int, rows: dict[str, torch.Tensor]) -> None:
        """All row tensors of the shard's k-th sample."""
        for name, t in rows.items():
            self.put(name, self.starts[k], t)
        self._todo.discard(k)

    def commit(self) -> int:
        if self._todo:
            raise RuntimeError(f"{self.path.name}: samples {sorted(self._todo)[:5]} were never written")
        os.close(self.fd)
        self.fd = -1  # closed: abort() must not close a number the OS may have given to another file
        try:
            commit_temp(self.tmp, self.path)
        except OSError as e:
            raise_write_error(self.path, e)
        return self.layout.size

    def abort(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        self.tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Reading


FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn values and float32 scales, one scale per vector on the last dim (amax -> 448)."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    return (x / scale[..., None]).to(torch.float8_e4m3fn), scale


def dequant_aux(aux: torch.Tensor, aux_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [T, n_aux*H] from stored aux rows (fp8 needs its aux_scale [T, n_aux])."""
    if aux_scale is None:
        return aux.float()
    t, n = aux_scale.shape
    return (aux.view(t, n, -1).float() * aux_scale[..., None]).view(t, -1)


@dataclass(frozen=True)
class SampleRef:
    """Where one sample's rows lie: shard index, row span, and its synth sample id."""

    shard: int
    start: int
    end: int
    sample_id: int

    @property
    def length(self) -> int:
        return self.end - self.start


def check_files(ds: Dataset, manifest: dict[str, Any], *, hash_limit: int = HASH_LIMIT_BYTES,
                consumer: str | None = None) -> list[Path]:
    """The shard paths the manifest lists, after refusing a missing, resized, changed or unlisted file (a
    shard `consumer` consumed is gone by design: its path is listed, unchecked)."""
    gone = refuse_consumed(ds, manifest, consumer)
    listed = {f["name"]: f for f in manifest.get("files", []) if f["name"] not in gone}
    n = int(manifest.get("params", {}).get("num_shards", -1))
    names = [shard_name(j) for j in range(n)]
    fix = f"check it with `eyas-data verify {ds.ref}`, then {_complete_fix(ds)}"
    unlisted = [j for j in names if j not in listed and j not in gone]
    if n < 1 or unlisted:
        raise DatasetError(f"{ds.ref}: the manifest lists {sum(j in listed or j in gone for j in names)} of its "
                           f"{max(n, 0)} shards ({', '.join(unlisted[:3]) or 'num_shards missing'}); {fix}")
    for name, entry in listed.items():
        p = ds.path / name
        if not p.is_file():
            raise DatasetError(f"{ds.ref}: {name} is listed in the manifest but missing from {ds.path}; {fix}")
        if p.stat().st_size != entry.get("bytes"):
            raise DatasetError(f"{ds.ref}: {name} is {p.stat().st_size} bytes, the manifest says "
                               f"{entry.get('bytes')} (truncated or replaced); {fix}")
    for p in sorted(ds.path.rglob("*")):
        rel = p.relative_to(ds.path).as_posix()
        if p.is_file() and rel != MANIFEST and not is_temp(p) and rel not in listed:
            raise DatasetError(f"{ds.ref}: {rel} is in {ds.path} but not in the manifest (a stray or foreign "
                               f"file); move it out of the dataset, or {fix}")
    if sum(listed[j]["bytes"] for j in names if j in listed) <= hash_limit:
        for name in (j for j in names if j in listed):
            if sha256_file(ds.path / name) != listed[name].get("sha256"):
                raise DatasetError(f"{ds.ref}: {name}: sha256 differs from the manifest (changed after it was "
                                   f"written); {fix}")
    return [ds.path / j for j in names]


def shard_problem(path: Path) -> str | None:
    """Why the shard file at `path` cannot be read (safetensors' words: a truncated file's header promises
    more bytes than there are), or None when it can."""
    try:
        safe_open(path, "pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        return str(e)
    return None


def open_shard(ds: Dataset, path: Path) -> Any:
    """A shard's safetensors handle (tensors read lazily, through mmap), refused in one line when unreadable."""
    try:
        return safe_open(path, "pt")
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise DatasetError(f"{ds.ref}: {path} is not a readable safetensors file ({e}); "
                           f"{_unreadable_fix(ds, path)}") from None


def _complete_fix(ds: Dataset) -> str:
    """The fix for a damaged file of a complete dataset: a rerun reports it done and changes nothing (its shards
    are its record), so the file is restored, or the dataset deleted first."""
    return f"restore the file from a copy, or {remake_fix(ds)}"


def _unreadable_fix(ds: Dataset, path: Path) -> str:
    """What makes an unreadable shard readable again: a rerun skips every shard file that is there, so in a
    partial dataset that file goes first."""
    if ds.manifest_path.exists() and ds.read_manifest().get("status") == "complete":
        return _complete_fix(ds)
    return f"delete that file (`rm {path}`) and rerun {REMAKE['hidden']} with the same options: it extracts it again"


@dataclass(frozen=True)
class ShardCounts:
    """What one shard holds, as the manifest's stats and records count it."""

    samples: int
    tokens: int
    masked_tokens: int
    bytes: int


def count_shard(ds: Dataset, j: int) -> ShardCounts:
    """Samples, tokens and loss-masked tokens of shard j, read from its offsets and mask alone."""
    path = ds.path / shard_name(j)
    h = open_shard(ds, path)
    offsets = h.get_tensor("offsets")
    return ShardCounts(len(offsets) - 1, int(offsets[-1]), int(h.get_tensor("loss_mask").sum()), path.stat().st_size)


class HiddenShards:
    """A hidden dataset read through mmap; `samples` in shard order (ascending sample id).

    Complete, it is opened whole (check_files). With `follow`, a partial dataset that `eyas-extract run
    --follow` is writing is opened as far as its manifest lists final shards (each one's bytes and sha256
    checked as it is taken), and `grow` takes the shards listed since; samples are only ever appended.
    """

    def __init__(self, ds: Dataset, manifest: dict[str, Any], *, hash_limit: int = HASH_LIMIT_BYTES,
                 follow: bool = False, consumer: str | None = None):
        self.ds, self.manifest, self.hash_limit, self.consumer = ds, manifest, hash_limit, consumer
        self.params: dict[str, Any] = manifest["params"]
        self.teacher: str = self.params["teacher"]
        self.files: list[Path] = []
        self.samples: list[SampleRef] = []
        self.shard_starts: list[int] = [0]  # shard i holds samples shard_starts[i]:shard_starts[i + 1]
        self._handles: dict[int, Any] = {}
        self.writer: dict[str, Any] | None = None  # the extract run writing it, as `grow` last found
        if self.complete:
            self._take(check_files(ds, manifest, hash_limit=hash_limit, consumer=consumer))
        elif follow:
            self._take(self._listed_final())
        else:
            raise DatasetError(f"{ds.ref}: status is {manifest.get('status')!r}, not 'complete'; rerun "
                               f"{REMAKE['hidden']} with the same name to finish it")

    @property
    def complete(self) -> bool:
        return self.manifest.get("status") == "complete"

    def grow(self) -> int:
        """Take the shards listed since the last look; the number taken. The writer is asked before the
        manifest is read, so a writer found gone has listed everything it made."""
        self.writer = any_holder(self.ds)
        self.manifest = self.ds.read_manifest()
        if self.complete:
            paths = check_files(self.ds, self.manifest, hash_limit=self.hash_limit, consumer=self.consumer)
            if [p.name for p in paths[:len(self.files)]] != [p.name for p in self.files]:
                raise DatasetError(f"{self.ds.ref}: its shards changed while it was read; {REMAKE['hidden']}")
            new = paths[len(self.files):]
        else:
            new = self._listed_final()[len(self.files):]
        self._take(new, start=len(self.files))
        return len(new)

    def _listed_final(self) -> list[Path]:
        """The final shards a partial manifest lists, from shard 0 up to the first one not listed yet; each
        new one is checked against its entry (bytes, sha256) before it is read."""
        listed = {f["name"]: f for f in self.manifest.get("files") or []}
        gone = refuse_consumed(self.ds, self.manifest, self.consumer)
        out: list[Path] = []
        while (entry := listed.get(shard_name(len(out)))) is not None:
            path = self.ds.path / entry["name"]
            if len(out) >= len(self.files) and path.name not in gone:
                if not path.is_file() or path.stat().st_size != entry.get("bytes") or \
                        sha256_file(path) != entry.get("sha256"):
                    raise DatasetError(f"{self.ds.ref}: {path.name} does not match its manifest entry (missing, "
                                       f"resized or changed after it was listed); rerun {REMAKE['hidden']}")
            out.append(path)
        return out

    def _take(self, paths: list[Path], start: int = 0) -> None:
        """Index the samples of `paths` (shards start, start + 1, ...). A consumed shard (its consumer resuming)
        is indexed from its entry's sample count, as placeholders that are never read: the consumer's plan
        only counts them."""
        entries = {f["name"]: f for f in self.manifest.get("files") or []}
        for i, path in enumerate(paths, start):
            self.files.append(path)
            if CONSUMED in entries.get(path.name, {}):
                self.samples += [SampleRef(i, 0, 0, -1)] * int(entries[path.name]["records"])
            else:
                h = self._handle(i)
                offsets, ids = h.get_tensor("offsets").tolist(), h.get_tensor("sample_ids").tolist()
                self.samples += [SampleRef(i, a, b, s) for a, b, s in zip(offsets[:-1], offsets[1:], ids)]
            self.shard_starts.append(len(self.samples))

    def __len__(self) -> int:
        return len(self.samples)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}

    @property
    def sample_ids(self) -> list[int]:
        return [r.sample_id for r in self.samples]

    def _handle(self, i: int) -> Any:
        if i not in self._handles:
            self._handles[i] = open_shard(self.ds, self.files[i])
        return self._handles[i]

    def sample(self, j: int) -> dict[str, Any]:
        """Every stored tensor of sample j, as stored (+ "sample_id")."""
        ref = self.samples[j]
        f = self._handle(ref.shard)
        out: dict[str, Any] = {k: f.get_slice(k)[ref.start:ref.end] for k in f.keys()
                               if k not in ("offsets", "sample_ids")}
        out["sample_id"] = ref.sample_id
        return out

    def aux(self, j: int) -> torch.Tensor:
        s = self.sample(j)
        return dequant_aux(s["aux"], s.get("aux_scale"))

    def read(self, ref: SampleRef, max_len: int) -> dict[str, torch.Tensor]:
        """One sample's first `max_len` rows for training: tokens, mask, aux as float32, the teacher signal."""
        h = self._handle(ref.shard)
        a, b = ref.start, min(ref.end, ref.start + max_len)
        out = {k: h.get_slice(k)[a:b] for k in ("input_ids", "loss_mask")}
        scale = h.get_slice("aux_scale")[a:b] if "aux_scale" in h.keys() else None
        out["aux"] = dequant_aux(h.get_slice("aux")[a:b], scale)
        for k in ("final",) if self.teacher == "final" else ("topk_ids", "topk_logprobs"):
            out[k] = h.get_slice(k)[a:b]
        return out

    def token_columns(self, shards: int | None = None) -> Any:
        """(input_ids, loss_mask) of each shard in turn (the first `shards` of them), whole."""
        for i in range(len(self.files) if shards is None else shards):
            h = self._handle(i)
            yield h.get_tensor("input_ids"), h.get_tensor("loss_mask")


def open_hidden(ref: str, data_root: Path | None = None, *, hash_limit: int = HASH_LIMIT_BYTES) -> HiddenShards:
    ds, manifest = open_input(ref, "hidden", root=data_root)
    return HiddenShards(ds, manifest, hash_limit=hash_limit)
