"""Process groups and data-parallel wrapping: torchrun (DDP or FSDP2; NCCL on GPU, gloo on CPU), or one
plain process when torchrun did not start us."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
from torch import nn
from eyas_common.procs import torchrun_ranks
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def init() -> Dist:
    """Join torchrun's process group when its environment is set; otherwise a single process."""
    cuda = torch.cuda.is_available()
    ranks = torchrun_ranks()
    if ranks.world <= 1:
        return Dist(0, 1, torch.device("cuda" if cuda else "cpu"))
    local = ranks.local_rank
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), torch.device(f"cuda:{local}" if cuda else "cpu"))


@cache  # asked at every forward pass (autocast); the CPU does not change under a running process
def native_bf16_cpu() -> bool:
    """True where this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there oneDNN's bf16 matmuls run about
    twice as fast as fp32 ones (bench/train.py --precision fp32,bf16)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def resolve_precision(precision: str, device: torch.device) -> str:
    """`bf16` or `fp32` for --precision: `auto` is bf16 on a GPU and on a CPU with native bf16 matmuls."""
    if precision != "auto":
        return precision
    return "bf16" if device.type == "cuda" or native_bf16_cpu() else "fp32"


def autocast(precision: str, device: torch.device) -> AbstractContextManager:
    """The forward pass in --precision: bf16 autocast (bf16 matmuls; fp32 weights, optimiser state and loss
    sums) or plain fp32."""
    bf16 = resolve_precision(precision, device) == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def shutdown(d: Dist) -> None:
    if d.distributed and dist.is_initialized():
        dist.destroy_process_group()


# What gloo and NCCL say when the process on the other end of a collective is gone (its host killed,
# its process crashed): torch raises these as plain RuntimeErrors or its DistBackendError.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout",
             "NCCL communicator was aborted", "remote process exited")


def peer_lost(e: BaseException, d: Dist) -> bool:
    """True when E is a collective failing because another rank stopped, not a bug of this one."""
    return d.distributed and isinstance(e, RuntimeError) and any(m in str(e) for m in PEER_GONE)


def all_sum(x: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.distributed:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def barrier(d: Dist) -> None:
    if d.distributed:
        dist.barrier()


def wrap(module: nn.Module, d: Dist, mode: str) -> nn.Module:
    """DDP or FSDP2 around the unrolled-loss module (one forward per optimiser step either way).

    Gradients are averaged over ranks by both, so the loss is scaled by the world size where the
    global-batch mean is wanted (see train.py). The frozen embedding is left out of FSDP's shards:
    it is replicated, never reduced.
    """
    if not d.distributed:
        return module
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [d.device.index] if d.device.type == "cuda" else None
        return DDP(module, device_ids=ids, broadcast_buffers=False)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        frozen = {p for p in module.parameters() if not p.requires_grad}
        # The draft is one layer: keeping it gathered between the unrolled steps costs little memory and
        # saves an all-gather per step.
        fully_shard(module, ignored_params=frozen, reshard_after_forward=False)
        return module
    raise ValueError(f"unknown parallel mode {mode!r}: ddp or fsdp")


def state_dicts(module: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Full (unsharded) model and optimiser state on CPU, without the frozen embedding; collective on
    every rank (FSDP gathers the shards). The same layout whatever the wrapping, so a checkpoint
    resumes under DDP, FSDP or one process alike."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(module, options=opts), get_optimizer_state_dict(module, opt, options=opts)


def load_state_dicts(module: nn.Module, opt: torch.optim.Optimizer, model_sd: dict, opt_sd: dict) -> None:
    # Every rank read the same checkpoint file, so no broadcast is needed; the frozen embedding was
    # loaded from the target and is not in the checkpoint (strict=False).
    opts = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, strict=False)
    set_model_state_dict(module, model_sd, options=opts)
    set_optimizer_state_dict(module, opt, opt_sd, options=opts)
