"""Reading a hidden dataset (stage 02's shards) and cutting it into deterministic global batches.

A shard `shard-{i:05d}.safetensors` holds, for its samples packed one after another (sample j = rows
offsets[j]:offsets[j+1]; row t = states computed at position t, no shift in the file):
    aux [T, 3H] bf16/fp32, or float8_e4m3fn with aux_scale [T, 3] fp32 (x = aux.view(T, 3, H) * scale)
    final [T, H]  or  topk_ids [T, K] int32 + topk_logprobs [T, K] fp32
    input_ids [T] int32, loss_mask [T] uint8, offsets [S+1] int64, sample_ids [S] int64
Shards are memory-mapped and a sample is sliced out when its batch is built, so a dataset far larger
than memory trains the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eyas_train.vocab import count_tokens


@dataclass(frozen=True)
class SampleRef:
    shard: int
    start: int
    end: int
    sample_id: int

    @property
    def length(self) -> int:
        return self.end - self.start


class HiddenShards:
    def __init__(self, path: Path):
        self.files = sorted(Path(path).glob("shard-*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"no shard-*.safetensors in {path}")
        self._handles = [safe_open(f, "pt") for f in self.files]
        self.samples: list[SampleRef] = []
        for i, h in enumerate(self._handles):
            offsets = h.get_tensor("offsets").tolist()
            ids = h.get_tensor("sample_ids").tolist()
            self.samples += [SampleRef(i, a, b, s) for a, b, s in zip(offsets[:-1], offsets[1:], ids)]
        keys = set(self._handles[0].keys())
        self.teacher = "final" if "final" in keys else "topk"
        if self.teacher == "topk" and not {"topk_ids", "topk_logprobs"} <= keys:
            raise ValueError(f"{self.files[0]}: neither `final` nor `topk_ids`/`topk_logprobs`: not a hidden shard")

    def __len__(self) -> int:
        return len(self.samples)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Loss-masked token counts over the whole dataset, one shard at a time."""
        total = torch.zeros(vocab_size, dtype=torch.long)
        for h in self._handles:
            total += count_tokens(h.get_tensor("input_ids"), h.get_tensor("loss_mask"), vocab_size)
        return total

    def read(self, ref: SampleRef, max_len: int) -> dict[str, torch.Tensor]:
        """One sample's rows (the first `max_len`), aux dequantised to fp32 when stored as fp8."""
        h = self._handles[ref.shard]
        a, b = ref.start, min(ref.end, ref.start + max_len)
        out = {k: h.get_slice(k)[a:b] for k in ("input_ids", "loss_mask")}
        aux = h.get_slice("aux")[a:b]
        if aux.dtype == torch.float8_e4m3fn:
            scale = h.get_slice("aux_scale")[a:b].float()
            aux = (aux.float().view(b - a, scale.shape[-1], -1) * scale[..., None]).view(b - a, -1)
        out["aux"] = aux
        for k in ("final",) if self.teacher == "final" else ("topk_ids", "topk_logprobs"):
            out[k] = h.get_slice(k)[a:b]
        return out


def global_batches(n: int, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Epoch `epoch`'s global batches of sample indices: a seeded permutation, the incomplete tail dropped
    (the same seed and epoch give the same batches whatever the number of processes)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch)).tolist()
    return [perm[i:i + batch_size] for i in range(0, n - batch_size + 1, batch_size)]


def rank_share(batch: list[int], lengths: list[int], rank: int, world: int) -> list[int]:
    """This rank's samples of a global batch: sorted by length and dealt round-robin, so ranks pad alike."""
    ordered = sorted(batch, key=lambda i: (lengths[i], i))
    return ordered[rank::world]


def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad samples to [B, T_max, ...]; padding is zeros (loss_mask 0 there)."""
    t = max(r["input_ids"].shape[0] for r in rows)
    out = {}
    for k in rows[0]:
        first = rows[0][k]
        buf = torch.zeros((len(rows), t, *first.shape[1:]), dtype=first.dtype)
        for i, r in enumerate(rows):
            buf[i, : r[k].shape[0]] = r[k]
        out[k] = buf
    out["input_ids"] = out["input_ids"].long()
    out["length"] = torch.tensor([r["input_ids"].shape[0] for r in rows])
    return out


def prefetch(shards: HiddenShards, plan: Iterator[list[int]], max_len: int) -> Iterator[dict[str, torch.Tensor]]:
    """Collated batches for the planned sample lists, the next one read in a background thread."""
    def load(idx: list[int]) -> dict[str, torch.Tensor]:
        return collate([shards.read(shards.samples[i], max_len) for i in idx])

    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for idx in plan:
            fut = pool.submit(load, idx)
            if pending is not None:
                yield pending.result()
            pending = fut
        if pending is not None:
            yield pending.result()
