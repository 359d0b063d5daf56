"""What is kept of a forward pass: the aux states and the final normed state, by forward hooks.

`output_hidden_states=True` would keep all L+1 states of every token; the hooks keep the few asked
for. `hidden_states[k]` in HF is the residual stream entering decoder layer k, so a pre-hook on
layer k sees it; the final norm's output is what lm_head reads. `encode` turns those states into
the stored rows (dtype, fp8 with per-token scales, or the top-K log-probs), for both backends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from eyas_common.contract import DatasetError

from eyas_extract.config import ExtractConfig
from eyas_common.hidden import DTYPES, quant_fp8

# Rows per lm_head chunk of the top-K teacher: bounds the [rows, V] float32 logits.
LOGIT_BYTES = 1 << 30


@dataclass
class Parts:
    """The pieces of a target found by its structure (a wrapper may nest the text model anywhere)."""

    base: nn.Module          # the module that owns the decoder layers and the final norm; called directly
    layers: nn.ModuleList    # decoder layers, L of them
    norm: nn.Module          # final norm: its output is the input of lm_head
    lm_head: nn.Module       # output embedding, [V, H]
    names: dict[str, str]    # where each was found, for messages and for loading its weights alone


def _norm_of(module: nn.Module, hidden: int) -> tuple[str, nn.Module] | None:
    norms = [(name, child) for name, child in module.named_children()
             if "norm" in type(child).__name__.lower()
             and tuple(getattr(getattr(child, "weight", None), "shape", ())) == (hidden,)]
    return norms[-1] if norms else None  # the last one: registered after the layers, it runs after them


def find_parts(model: nn.Module, num_layers: int, hidden: int) -> Parts:
    """Locate decoder layers, final norm and lm_head; fail listing what was found when one is missing."""
    modules = dict(model.named_modules())
    stacks = [(n, m) for n, m in modules.items() if isinstance(m, nn.ModuleList) and len(m) > 0]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for name, stack in stacks:
        if head is None or len(stack) != num_layers or len({type(x) for x in stack}) != 1:
            continue
        parent_name = name.rpartition(".")[0]
        parent = modules[parent_name]
        norm = _norm_of(parent, hidden)
        if norm is None:
            continue
        head_name = next(n for n, m in modules.items() if m is head)
        return Parts(parent, stack, norm[1], head, {
            "base": parent_name, "layers": name, "norm": f"{parent_name}.{norm[0]}".lstrip("."), "lm_head": head_name})
    listing = ", ".join(f"{n or '<root>'} ({len(m)} x {type(m[0]).__name__})" for n, m in stacks) or "none"
    inside = tuple(f"{n}." for n, _ in stacks)
    norms = ", ".join(f"{n} ({type(m).__name__})" for n, m in modules.items()
                      if "norm" in type(m).__name__.lower() and not n.startswith(inside)) or "none"
    head_type = type(head).__name__ if head is not None else "none"
    raise DatasetError(
        f"cannot locate the decoder stack of {type(model).__name__}: wanted a list of {num_layers} identical layers "
        f"whose parent also holds a final norm of width {hidden}, and an output embedding (lm_head). Found layer "
        f"lists: {listing}; norms outside them: {norms}; lm_head: {head_type}. "
        f"Is --model a causal LM checkpoint (with --trust-remote-code if it ships its own code)?")


class Capture:
    """Hooks that keep, per forward, the states entering `layers` and the final norm's output."""

    def __init__(self, parts: Parts, layers: list[int]):
        self.parts, self.layers = parts, layers
        self.states: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._handles: list[Any] = []

    def __enter__(self) -> "Capture":
        for k in sorted(set(self.layers)):
            self._handles.append(self.parts.layers[k].register_forward_pre_hook(self._pre(k), with_kwargs=True))
        self._handles.append(self.parts.norm.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre(self, k: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.states[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _post(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.final = out[0] if isinstance(out, tuple) else out

    def rows(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [N, n_aux, H], final [N, H]) at the flat positions `index` of the last forward."""
        assert self.final is not None, "no forward ran under this Capture"
        dev = self.final.device  # with a device_map the layers live on several GPUs: gather on the last

        def take(x: torch.Tensor) -> torch.Tensor:
            return x.flatten(0, 1)[index.to(x.device, non_blocking=True)].to(dev, non_blocking=True)

        aux = torch.stack([take(self.states[k]) for k in self.layers], dim=1)
        final = take(self.final)
        self.states.clear()
        self.final = None
        return aux, final


def topk_logprobs(final: torch.Tensor, lm_head: nn.Module, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K of log_softmax(lm_head(final)) in float32, chunked so the logits stay under LOGIT_BYTES."""
    rows = max(1, LOGIT_BYTES // (4 * vocab))
    ids, lps = [], []
    for chunk in final.split(rows):
        logits = lm_head(chunk).float()
        v, i = logits.topk(k, dim=-1)
        # log_softmax at the top K only: no second [rows, V] tensor is written.
        lps.append(v - logits.logsumexp(dim=-1, keepdim=True))
        ids.append(i.to(torch.int32))
    return torch.cat(ids), torch.cat(lps)


def encode(cfg: ExtractConfig, aux: torch.Tensor, final: torch.Tensor | None = None, *,
           lm_head: nn.Module | None = None, topk: tuple[torch.Tensor, torch.Tensor] | None = None
           ) -> dict[str, torch.Tensor]:
    """Stored rows from states: aux [N, n_aux, H] and, by teacher, final [N, H] or the top-K (ids, logprobs).

    With teacher topk, pass either `final` and the `lm_head` to compute it, or `topk` computed elsewhere.
    """
    n = aux.shape[0]
    out: dict[str, torch.Tensor] = {}
    if cfg.aux_dtype == "fp8":
        q, scale = quant_fp8(aux)
        out["aux"], out["aux_scale"] = q.view(n, -1), scale
    else:
        out["aux"] = aux.to(DTYPES[cfg.aux_dtype]).reshape(n, -1)
    if cfg.teacher == "final":
        out["final"] = final.to(DTYPES[cfg.stored_dtype])
    else:
        ids, lps = topk if topk is not None else topk_logprobs(final, lm_head, cfg.topk, cfg.vocab_size)
        out["topk_ids"], out["topk_logprobs"] = ids, lps
    return out
