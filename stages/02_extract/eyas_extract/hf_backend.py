"""The hf backend: the target in transformers, one padded forward per batch, states taken by hooks.

Exact and general: it runs any model transformers loads, on CPU too. Batches are right-padded and
run without an attention mask: attention is causal, so a real token never sees the padding after
it, and the (garbage) padded rows are dropped before anything is stored. That keeps sdpa on its
causal fast path and flash-attn on its plain one. The decoder stack is called directly (not the
CausalLM), so the [tokens, vocab] logits are computed only where the top-K teacher needs them.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator

import torch

from eyas_common.chat import refuse_remote_code
from eyas_common.contract import DatasetError

from eyas_extract.capture import Capture, encode, find_parts
from eyas_common.hidden import torch_dtype
from eyas_extract.config import ExtractConfig



DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # transformers' named device_map strategies


def pick_device(device: str, *, here: bool = True, option: str = "--device",
                fix: str = "pass --device cpu, or auto (a GPU when there is one)") -> torch.device:
    """`--device` as a torch device. Refused in one line, before anything is written, when it names no device
    the hf backend runs on or (`here`: not a dry run planning another machine) a GPU this machine lacks;
    torch would only fail once the target loads, leaving a started dataset that a rerun must match."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise DatasetError(f"{option} {device!r}: not a device the hf backend runs on (cpu, cuda, cuda:N); {fix}")
    if here and dev.type == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not gpus:
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise DatasetError(f"{option} {device}: {why}; {fix}")
        if dev.index is not None and dev.index >= gpus:
            raise DatasetError(f"{option} {device}: this machine has {gpus} CUDA GPU(s), cuda:0 to "
                               f"cuda:{gpus - 1}; {fix}")
    return dev


def check_device_map(device_map: str | None, *, here: bool = True) -> None:
    """`--device-map`: one of transformers' strategies or one device, checked before anything is written."""
    if device_map is not None and device_map not in DEVICE_MAPS:
        pick_device(device_map, here=here, option="--device-map",
                    fix=f"pass a strategy ({', '.join(DEVICE_MAPS)}) or a device this machine has")


def pick_dtype(dtype: str, device: torch.device) -> str:
    """bf16 on GPU; fp32 on CPU, where bf16 matmuls are slow and buy nothing."""
    if dtype == "auto":
        return "bfloat16" if device.type == "cuda" else "float32"
    return str(torch_dtype(dtype)).removeprefix("torch.")  # torch's own name, as transformers takes it


def pick_attn(attn: str, device: torch.device, dtype: str) -> str:
    """flash-attn where it runs (a GPU, 16-bit weights, the package installed), else sdpa."""
    if attn != "auto":
        return attn
    if device.type == "cuda" and dtype == "bfloat16" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_target(cfg: ExtractConfig, device: torch.device, offload_folder: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": torch_dtype(cfg.dtype), "trust_remote_code": cfg.trust_remote_code}
    # With accelerate, weights load straight onto the device (or across several, device_map "auto").
    direct = cfg.device_map or (str(device) if importlib.util.find_spec("accelerate") else None)
    if direct:
        kwargs["device_map"] = direct
    if cfg.device_map and cfg.max_memory:
        kwargs["max_memory"] = {int(k) if k.isdigit() else k: v for k, v in cfg.max_memory.items()}
    if offload_folder:  # what fits no device is offloaded to disk by accelerate (slow, but it runs)
        kwargs["offload_folder"] = offload_folder
    try:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, attn_implementation=cfg.attn, **kwargs)
    except (ValueError, ImportError) as e:
        refuse_remote_code(cfg.model, e, cfg.trust_remote_code)
        # Remote-code models often support neither flash-attn nor sdpa through transformers.
        if cfg.attn == "eager" or "attention" not in str(e).lower():
            raise
        print(f"[extract] attention {cfg.attn} unavailable for this model ({e}); using eager", file=sys.stderr)
        cfg.attn = "eager"
        model = AutoModelForCausalLM.from_pretrained(cfg.model, attn_implementation="eager", **kwargs)
    if not direct:
        model.to(device)
    return model.eval().requires_grad_(False)


class HFBackend:
    def __init__(self, cfg: ExtractConfig, device: torch.device):
        self.cfg = cfg
        self.offload = tempfile.mkdtemp(prefix="eyas-offload-") if cfg.device_map else None
        self.model = load_target(cfg, device, self.offload)
        if cfg.device_map:
            spread = Counter(str(d) for d in getattr(self.model, "hf_device_map", {}).values())
            print(f"[extract] device_map: {dict(spread)} (modules per device)", file=sys.stderr, flush=True)
        self.parts = find_parts(self.model, cfg.num_layers, cfg.hidden_size)
        self.device = self.parts.base.get_input_embeddings().weight.device
        with torch.inference_mode():  # the first forward pays one-time kernel and allocator set-up
            self.parts.base(input_ids=torch.zeros(1, 8, dtype=torch.long, device=self.device), use_cache=False)

    def extract(self, tokens: list[list[int]], batches: list[list[int]]
                ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
        """Per batch: its sample indices, and their stored rows concatenated in that order."""
        with Capture(self.parts, self.cfg.layers) as cap, torch.inference_mode():
            for batch in batches:
                ids, index = pad_batch([tokens[k] for k in batch])
                self.parts.base(input_ids=ids.to(self.device, non_blocking=True), use_cache=False)
                aux, final = cap.rows(index)
                yield batch, encode(self.cfg, aux, final, lm_head=self.parts.lm_head)

    def close(self) -> None:
        del self.model
        if self.offload:
            shutil.rmtree(self.offload, ignore_errors=True)


def pad_batch(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, longest] and the flat positions of the real tokens, sample after sample."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    index = torch.cat([torch.arange(len(s)) + b * width for b, s in enumerate(seqs)])
    return ids, index
