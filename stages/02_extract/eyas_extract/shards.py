"""The hidden dataset's shard files: their layout, the writer, and the reader the train stage uses.

`hidden/NAME/shard-{i:05d}.safetensors` (a final name appears only by atomic rename) holds, for the
S samples of shard i (ascending sample id) and their T tokens in total:
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

Reader API (stable; the train stage imports it):
    ds = open_hidden("hidden/NAME")    # refuses a partial, unknown or missing dataset, naming the fix
    ds.params                          # manifest params: layers, hidden_size, aux_dtype, teacher, topk, ...
    len(ds); ds.sample_ids             # samples in ascending sample id, across shards
    ds.sample(j)                       # {tensor name: rows of sample j} (+ "sample_id"), read through mmap
    ds.aux(j)                          # float32 [T, n_aux*H], dequantised when stored as fp8
    dequant_aux(aux, aux_scale)        # the same for rows already read
Handles are opened lazily and dropped on pickling, so a dataset can go to DataLoader workers.
"""

from __future__ import annotations

import bisect
import errno
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas_common.contract import Dataset, DatasetError, fsync_dir, open_input

from eyas_extract.config import ExtractConfig

FORMAT = "eyas.hidden/1"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
# safetensors' names for the dtypes a shard uses.
_ST_NAME = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.float8_e4m3fn: "F8_E4M3", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8"}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def row_tensors(cfg: ExtractConfig) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The per-token tensors of a shard: name -> (dtype, shape of one row)."""
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


def bytes_per_token(cfg: ExtractConfig) -> int:
    return sum(dt.itemsize * math.prod(shape) for dt, shape in row_tensors(cfg).values())


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one shard lies; the file's size is known before anything is computed."""

    header: bytes                       # 8-byte length + JSON header, padded to 8 bytes
    spans: dict[str, tuple[int, int]]   # name -> (start, bytes per row) in the file
    size: int                           # file bytes


def shard_layout(cfg: ExtractConfig, n_samples: int, n_tokens: int) -> Layout:
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

    def __init__(self, path: Path, cfg: ExtractConfig, sample_ids: list[int], lengths: list[int]):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
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
                raise _disk_error(self.path, e) from e
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
                raise _disk_error(self.path, e) from e
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
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.layout.size

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        self.tmp.unlink(missing_ok=True)


def _disk_error(path: Path, e: OSError) -> Exception:
    if e.errno == errno.ENOSPC:
        return DatasetError(f"disk full while writing {path}: free space or point EYAS_DATA at a larger volume, "
                            f"then rerun the same command (finished shards are kept)")
    return e


# ---------------------------------------------------------------------------------------------
# Reading


def dequant_aux(aux: torch.Tensor, aux_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [T, n_aux*H] from stored aux rows (fp8 needs its aux_scale [T, n_aux])."""
    if aux_scale is None:
        return aux.float()
    t, n = aux_scale.shape
    return (aux.view(t, n, -1).float() * aux_scale[..., None]).view(t, -1)


class HiddenDataset:
    """A complete hidden dataset; samples in ascending sample id, read lazily through mmap."""

    def __init__(self, ds: Dataset, manifest: dict[str, Any]):
        self.ds, self.manifest = ds, manifest
        self.params: dict[str, Any] = manifest["params"]
        self.paths = [ds.path / f["name"] for f in manifest["files"] if f["name"].startswith("shard-")]
        self._first: list[int] = []        # global index of each shard's first sample
        self._offsets: list[list[int]] = []
        self.sample_ids: list[int] = []
        for p in self.paths:
            with safe_open(p, "pt") as f:
                self._first.append(len(self.sample_ids))
                self._offsets.append(f.get_tensor("offsets").tolist())
                self.sample_ids += f.get_tensor("sample_ids").tolist()
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.sample_ids)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}

    def _handle(self, s: int) -> Any:
        if s not in self._handles:
            self._handles[s] = safe_open(self.paths[s], "pt")
        return self._handles[s]

    def sample(self, j: int) -> dict[str, torch.Tensor | int]:
        if not 0 <= j < len(self):
            raise IndexError(f"sample {j} of {len(self)}")
        s = bisect.bisect_right(self._first, j) - 1
        k = j - self._first[s]
        a, b = self._offsets[s][k], self._offsets[s][k + 1]
        f = self._handle(s)
        out: dict[str, torch.Tensor | int] = {name: f.get_slice(name)[a:b] for name in f.keys()
                                               if name not in ("offsets", "sample_ids")}
        out["sample_id"] = self.sample_ids[j]
        return out

    def aux(self, j: int) -> torch.Tensor:
        s = self.sample(j)
        return dequant_aux(s["aux"], s.get("aux_scale"))


def open_hidden(ref: str, data_root: Path | None = None) -> HiddenDataset:
    ds, manifest = open_input(ref, "hidden", root=data_root)
    return HiddenDataset(ds, manifest)
