"""What training needs from the target, read from its files alone (its config and tensor index through
eyas_common.checkpoint): embedding, lm_head, and the teacher distribution built from stored final states
or stored top-K. The target model itself is never
loaded for training (the eval loads it, since it runs the target).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eyas_common.checkpoint import read_text_config, weight_files
from eyas_common.contract import DatasetError
from eyas_train.vocab import VocabMap


TEXT_PREFIX = "language_model."


def weight_name(model: str | Path, names: dict[str, Path], suffix: str) -> str:
    """The name of the one tensor of `names` (weight_files) that ends with `suffix`; KeyError saying what is there."""
    found = sorted(k for k in names if k == suffix or k.endswith("." + suffix))
    if len(found) > 1:  # a multimodal wrapper (Kimi-K2.5): the text model's, under `language_model.`
        found = [k for k in found if k.startswith(TEXT_PREFIX)] or found
    if len(found) != 1:
        what = "no tensor" if not found else f"{len(found)} tensors ({', '.join(found[:4])})"
        near = sorted(k for k in names if suffix.split(".")[0] in k)[:8]
        raise KeyError(f"{model}: {what} named *{suffix}; similar names: {near or sorted(names)[:8]}")
    return found[0]


def load_weight(model: str | Path, suffix: str) -> torch.Tensor:
    """The one tensor whose name ends with `suffix` (e.g. `embed_tokens.weight`), read alone."""
    names = weight_files(Path(model))
    name = weight_name(model, names, suffix)
    with safe_open(names[name], "pt") as h:
        return h.get_tensor(name)


def check_model(model: str | Path, hidden_ref: str, params: dict[str, Any]) -> None:
    """Refuse, in one line, a --model whose files cannot give what training reads from them (config, embedding,
    final norm, lm_head), or that is not the target `hidden_ref` was extracted from: a model sharing its
    tokenizer (another size of the same family) passes the tokenizer check but not this one."""
    fix = f"pass the target {hidden_ref} was extracted from ({params.get('model')})"
    try:
        target = read_text_config(model)
        names = weight_files(Path(model))
        for suffix in ("embed_tokens.weight", "model.norm.weight") + (
                () if target.get("tie_word_embeddings", False) else ("lm_head.weight",)):
            weight_name(model, names, suffix)
    except KeyError as e:
        raise DatasetError(f"--model {e.args[0]}; {fix}") from None
    except (OSError, ValueError) as e:  # no config.json or safetensors; a cut-short file; malformed JSON
        where = str(e) if str(e).startswith(str(model)) else f"{model}: {e}"  # weight_files' name the file
        raise DatasetError(f"--model {where}; {fix}") from None
    differ = [f"{key} {target.get(key)} (the dataset's: {params[made]})" for key, made in (
        ("hidden_size", "hidden_size"), ("num_hidden_layers", "num_layers"), ("vocab_size", "vocab_size"))
        if params.get(made) is not None and target.get(key) != params[made]]
    if differ:
        raise DatasetError(f"--model {model} is not the target {hidden_ref} was extracted from: its config.json has "
                           f"{', '.join(differ)}; {fix}, or extract a hidden dataset from this one")


def load_embedding(model: str | Path) -> torch.Tensor:
    return load_weight(model, "embed_tokens.weight")


def load_lm_head(model: str | Path) -> torch.Tensor:
    """The target's output projection [V, H]; the embedding when the target ties them."""
    if read_text_config(model).get("tie_word_embeddings", False):
        return load_embedding(model)
    return load_weight(model, "lm_head.weight")


class Teacher:
    """The target's next-token distribution P_t restricted to the draft vocabulary (renormalised), and its
    full-vocabulary argmax (what greedy verification accepts), from a batch's stored teacher fields."""

    def __init__(self, vocab: VocabMap, lm_head: torch.Tensor | None, device: torch.device, chunk_rows: int = 2048):
        self.keep = vocab.draft_to_target.to(device)
        self.to_draft = vocab.target_to_draft.to(device)
        self.lm_head = None if lm_head is None else lm_head.to(device)
        self.chunk_rows = chunk_rows

    @torch.no_grad()
    def __call__(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if "final" in batch:
            return self._from_final(batch["final"])
        return self._from_topk(batch["topk_ids"].long(), batch["topk_logprobs"].float())

    def _from_final(self, final: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lm_head is None:
            raise ValueError("the hidden dataset stores final states but no target lm_head was loaded")
        rows = final.reshape(-1, final.shape[-1])
        probs, top = [], []
        # Row chunks bound the full-vocabulary logits (163840 columns for Kimi) in memory.
        for part in rows.split(self.chunk_rows):
            logits = (part.to(self.lm_head.dtype) @ self.lm_head.T).float()
            top.append(logits.argmax(-1))
            probs.append(torch.softmax(logits[:, self.keep], dim=-1))
        shape = final.shape[:-1]
        return torch.cat(probs).view(*shape, -1), torch.cat(top).view(shape)

    def _from_topk(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        draft = self.to_draft[ids]
        kept = draft >= 0
        # Renormalise over the top-K entries inside the draft vocabulary; the rest of the mass is unknown.
        p = torch.softmax(logprobs.masked_fill(~kept, float("-inf")), dim=-1).nan_to_num(0.0)
        out = torch.zeros(*ids.shape[:-1], self.keep.numel(), device=ids.device)
        out.scatter_add_(-1, draft.clamp(min=0), p * kept)
        top = ids.gather(-1, logprobs.argmax(-1, keepdim=True)).squeeze(-1)
        return out, top


def attention_shape(target: dict[str, Any], hidden_size: int) -> tuple[int, int, dict[str, Any]]:
    """A draft layer's heads, head_dim and RoPE parameters, as one of the target's layers has them."""
    heads = target["num_attention_heads"]
    # MLA targets (DeepseekV3 / Kimi) have no Llama head_dim; the draft's Llama layer splits H evenly.
    head_dim = (None if "kv_lora_rank" in target else target.get("head_dim")) or hidden_size // heads
    rope = dict(target.get("rope_parameters") or target.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", target.get("rope_theta", 10000.0))
    return heads, head_dim, rope
