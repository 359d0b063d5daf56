"""Where the target goes: one process over all devices (device_map), N data-parallel copies, or vLLM.

Decided from the checkpoint's size (its safetensors index or headers, eyas_common.checkpoint) and the
devices' memory, before anything loads:
- data-parallel ranks (torchrun) only when a full copy fits one device, each rank a copy;
- otherwise one process with a `device_map` spreading the layers over every local device (a pipeline:
  one device works at a time; the capture hooks run on whichever device holds their layer);
- with `--backend vllm`: tensor parallel over enough devices (and expert parallel for an MoE).
An impossible request (NPROC=8 full copies of a model larger than one device, or a model larger than
all devices together) is refused with the alternative named.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from eyas_common.checkpoint import CheckpointSize
from eyas_common.contract import DatasetError

# Of each device's memory: kept for activations, the allocator and the CUDA context.
HEADROOM = 0.10
# Assumed utilisation of a device's peak for the time estimate (a forward without the logits).
ASSUMED_MFU = 0.35
# Dense bf16 peak, FLOP/s, by device name; unknown GPUs use the smallest.
PEAK_FLOPS = {"B200": 2.25e15, "B300": 2.25e15, "H200": 0.99e15, "H100": 0.99e15, "H20": 0.148e15,
              "A100": 0.312e15, "RTX PRO 6000": 0.5e15, "L40S": 0.362e15, "5090": 0.21e15}
# A CPU core's fp32 peak, FLOP/s: two 8-wide FMA units at ~3 GHz. Anchor: SmolLM2-135M (2.7e8 FLOP a token)
# extracted at ~400 tokens/s on 2 EPYC cores, ~55% of this; a whole-CPU 5e10 had guessed 6x too slow.
CPU_CORE_FLOPS = 1e11


@dataclass(frozen=True)
class Devices:
    kind: str                 # cuda | cpu
    memory: list[int]         # bytes per device (host RAM for cpu)
    name: str = ""            # e.g. "NVIDIA H200" (the time estimate's peak)

    @classmethod
    def detect(cls) -> "Devices":
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            return cls("cuda", [torch.cuda.get_device_properties(i).total_memory for i in range(n)],
                       torch.cuda.get_device_name(0))
        return cls("cpu", [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")], "cpu")

    @classmethod
    def parse(cls, spec: str) -> "Devices":
        """`8x96GB`, `2x80GiB` or `cpu:24GB`: a machine described instead of detected (dry runs, tests)."""
        try:
            if spec.startswith("cpu:"):
                found = cls("cpu", [_bytes(spec[4:])], "cpu")
            else:
                count, _, size = spec.lower().partition("x")
                found = cls("cuda", [_bytes(size)] * int(count), "")
            if found.memory and min(found.memory) > 0:  # a plan needs a device, and memory on it
                return found
        except (ValueError, OverflowError):  # OverflowError: an infinite size
            pass
        raise DatasetError(f"--devices {spec!r}: expected NxSIZE (8x96GB) or cpu:SIZE (cpu:24GB), N and SIZE above 0")


def _bytes(size: str) -> int:
    size = size.strip().upper()
    for unit, mult in (("GIB", 1 << 30), ("GB", 10**9), ("TIB", 1 << 40), ("TB", 10**12)):
        if size.endswith(unit):
            return int(float(size[: -len(unit)]) * mult)
    raise ValueError(size)


@dataclass
class Plan:
    kind: str                         # data_parallel | device_map | vllm
    ranks: int                        # processes (torchrun ranks) that each load the target
    devices: int                      # devices the target is spread over, per copy
    model_bytes: int                  # weights as loaded
    device_bytes: int                 # memory of one device
    max_memory: dict[str, str] | None = None   # device_map: per-device budget given to transformers
    tensor_parallel_size: int = 1     # vllm
    enable_expert_parallel: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        gb = self.model_bytes / 1e9
        if self.kind == "data_parallel":
            head = f"{self.ranks} data-parallel rank(s), each a full copy ({gb:,.1f} GB) on one device"
        elif self.kind == "device_map":
            head = (f"1 process, device_map over {self.devices} device(s) ({gb:,.1f} GB spread as a pipeline; "
                    f"max_memory {self.max_memory})")
        else:
            head = (f"vLLM, tensor_parallel_size {self.tensor_parallel_size}"
                    f"{', enable_expert_parallel' if self.enable_expert_parallel else ''} ({gb:,.1f} GB)")
        return "; ".join([head, *self.notes])


def _usable(device_bytes: int) -> int:
    return int(device_bytes * (1 - HEADROOM))


def plan_placement(*, size: CheckpointSize, devices: Devices, dtype: str, backend: str = "hf",
                   nproc: int = 1, device_map: str | None = None) -> Plan:
    """The placement for this target on these devices, or a DatasetError naming what would work."""
    need = size.load_bytes(dtype)
    per, n = min(devices.memory), len(devices.memory)
    total = _usable(per) * n
    moe = bool(size.text.get("n_routed_experts"))
    if backend == "vllm":
        return _plan_vllm(need, per, n, moe, nproc)
    if need > total:
        raise DatasetError(
            f"the target needs {need / 1e9:,.1f} GB as loaded ({dtype}) but {n} {devices.kind} device(s) of "
            f"{per / 1e9:,.1f} GB hold {total / 1e9:,.1f} GB after {HEADROOM:.0%} headroom: use a machine with more "
            f"memory, a quantized checkpoint, or --backend vllm on a host that serves it")
    fits_one = need <= _usable(per)
    if nproc > 1 and not fits_one:
        raise DatasetError(
            f"NPROC={nproc} starts {nproc} ranks that each load a full copy ({need / 1e9:,.1f} GB), but one device "
            f"holds {per / 1e9:,.1f} GB: run one process (NPROC=1), which spreads the target over all {n} devices "
            f"with a device_map, or --backend vllm (tensor_parallel_size {_tp_for(need, per, n)})")
    if nproc > n and devices.kind == "cuda":
        raise DatasetError(f"NPROC={nproc} ranks but {n} GPU(s): one rank per GPU (NPROC={n} at most)")
    if fits_one and not device_map:
        notes = [] if nproc > 1 or n == 1 else [f"a copy fits one device: NPROC={n} would run {n} ranks side by side"]
        return Plan("data_parallel", nproc, 1, need, per, notes=notes)
    budget = {("cpu" if devices.kind == "cpu" else str(i)): f"{_usable(m) // (1 << 20)}MiB"
              for i, m in enumerate(devices.memory)}
    return Plan("device_map", 1, n, need, per, max_memory=budget,
                notes=["one device computes at a time (a pipeline): rate about that of one device"])


def _tp_for(need: int, per: int, n: int) -> int:
    tp = 1
    while tp < n and need > _usable(per) * tp:
        tp *= 2
    return min(tp, n)


def _plan_vllm(need: int, per: int, n: int, moe: bool, nproc: int) -> Plan:
    if nproc > 1:
        raise DatasetError(f"--backend vllm runs in one process that drives all GPUs itself (tensor parallel): "
                           f"use NPROC=1, not {nproc}")
    if need > _usable(per) * n:
        raise DatasetError(f"the target needs {need / 1e9:,.1f} GB but {n} device(s) of {per / 1e9:,.1f} GB hold "
                           f"{_usable(per) * n / 1e9:,.1f} GB: vLLM cannot hold it on this host")
    tp = _tp_for(need, per, n)
    if n % tp:
        tp = n
    notes = ["routed experts split over the ranks (expert parallel)"] if moe and tp > 1 else []
    return Plan("vllm", 1, tp, need, per, tensor_parallel_size=tp, enable_expert_parallel=moe and tp > 1, notes=notes)


def estimate_seconds(plan: Plan, size: CheckpointSize, devices: Devices, tokens: int) -> float:
    """A rough forward-only time: 2 x active params FLOPs per token at ASSUMED_MFU of the peak."""
    active = size.active_params() or estimate_active_params(size.text)
    peak = CPU_CORE_FLOPS * len(os.sched_getaffinity(0)) if devices.kind == "cpu" else next(
        (v for k, v in PEAK_FLOPS.items() if k in devices.name), min(PEAK_FLOPS.values()))
    working = plan.ranks if plan.kind == "data_parallel" else plan.tensor_parallel_size
    return 2 * active * tokens / (peak * ASSUMED_MFU * max(1, working))


def estimate_active_params(text: dict[str, Any]) -> int:
    """Active parameters per token from a (Llama / DeepseekV3-style) config, for an index without headers."""
    h, layers, v = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    dense_ffn = 3 * h * text.get("intermediate_size", 4 * h)
    routed = text.get("n_routed_experts") or 0
    first_dense = text.get("first_k_dense_replace", 0) if routed else layers
    moe_ffn = 3 * h * text.get("moe_intermediate_size", 0) * (
        (text.get("num_experts_per_tok") or 0) + (text.get("n_shared_experts") or 0))
    attn = 4 * h * h
    return 2 * v * h + layers * attn + first_dense * dense_ffn + (layers - first_dense) * moe_ffn


def format_seconds(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


SHARD_WORK_S = 30 * 60  # past this much work per shard the start line suggests smaller shards


def shard_work_note(seconds: float, shards: int, disk_bytes: int) -> str | None:
    """A hint when each shard is long work: an interrupted run keeps only its finished shards (the default
    2 GiB shard is seconds of GPU work, and can be hours on a CPU)."""
    if shards < 1 or seconds / shards <= SHARD_WORK_S:
        return None
    mib = max(1, int(disk_bytes * (SHARD_WORK_S / 2) / seconds) >> 20)  # the MiB made in half that time
    return (f"each of the {shards} shard(s) is about {format_seconds(seconds / shards)} of work, and an interrupted "
            f"run keeps only finished shards: --shard-mb {mib} makes one about every "
            f"{format_seconds(SHARD_WORK_S / 2)}")


def tokens_note(tokens: int, seconds: float) -> str:
    return f"{tokens:,} tokens in about {format_seconds(seconds)} (at {ASSUMED_MFU:.0%} of peak; a guess, not a measure)"

