"""The draft folder vLLM and SGLang load (docs/interop.md), from this package's module and back.

The folder's files are owned by eyas_common.drafts; this module maps the module's state to them.
The weight names go through NAME_MAP, the one place that ties this package's module to the servers.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eyas_common.drafts import ARCHITECTURE, WEIGHTS_FILE, write_weights
from eyas_common.drafts import read_config as read_config_json
from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.target import load_embedding

# internal name (Eagle3Draft.state_dict) -> exported name. `midlayer.`, not `layers.0.`: SGLang silently
# ignores the latter, vLLM maps `midlayer.` to its `layers.0.`.
NAME_MAP: dict[str, str] = {
    "fc.weight": "fc.weight",
    "layer.embed_norm.weight": "midlayer.input_layernorm.weight",
    "layer.hidden_norm.weight": "midlayer.hidden_norm.weight",
    "layer.attn.wq.weight": "midlayer.self_attn.q_proj.weight",
    "layer.attn.wk.weight": "midlayer.self_attn.k_proj.weight",
    "layer.attn.wv.weight": "midlayer.self_attn.v_proj.weight",
    "layer.attn.wo.weight": "midlayer.self_attn.o_proj.weight",
    "layer.mlp_norm.weight": "midlayer.post_attention_layernorm.weight",
    "layer.mlp.w_gate.weight": "midlayer.mlp.gate_proj.weight",
    "layer.mlp.w_up.weight": "midlayer.mlp.up_proj.weight",
    "layer.mlp.w_down.weight": "midlayer.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",  # left out with the identity map (exported_tensors)
    "t2d": "t2d",
}
# Kept out of the file: the frozen target embedding, which the servers take from the target itself.
NOT_EXPORTED = frozenset({"embed.weight"})


def full_vocab(d2t: torch.Tensor, t2d: torch.Tensor) -> bool:
    """The draft vocabulary is the whole target vocabulary, in order (the identity map)."""
    return d2t.numel() == t2d.numel() and not d2t.any()


def exported_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Internal state dict -> exported tensors; refuses a name the map does not know, or a missing one.

    With the identity vocabulary map d2t and t2d are left out: vLLM builds no d2t parameter when the
    draft vocabulary equals the target's and refuses to load one; SGLang then uses the full vocabulary.
    """
    unknown = sorted(set(state) - set(NAME_MAP) - NOT_EXPORTED)
    missing = sorted(set(NAME_MAP) - set(state))
    if unknown or missing:
        raise KeyError(f"draft state does not match NAME_MAP: unknown {unknown}, missing {missing}")
    skip = {"d2t", "t2d"} if full_vocab(state["d2t"], state["t2d"]) else set()
    out = {}
    for name, new in NAME_MAP.items():
        if name in skip:
            continue
        t = state[name].detach().cpu()
        out[new] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def imported_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exported tensors -> internal names (NAME_MAP reversed), for loading a draft back."""
    back = {v: k for k, v in NAME_MAP.items()}
    unknown = sorted(set(tensors) - set(back))
    if unknown:
        more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        raise KeyError(f"unexpected tensors in the draft file: {unknown[:4]}{more} (not an EAGLE-3 draft's: "
                       f"{NAME_MAP['fc.weight']}, {NAME_MAP['layer.attn.wq.weight']}, ...)")
    return {back[k]: v for k, v in tensors.items()}


def hf_config(cfg: DraftConfig, aux_layer_ids: list[int], target: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """config.json for the servers: a one-layer Llama config plus the EAGLE-3 keys."""
    rope = dict(cfg.rope_parameters)
    legacy_scaling = None if rope.get("rope_type", "default") == "default" else rope
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        # transformers 5 reads rope_parameters; older readers (SGLang images) read rope_theta/rope_scaling.
        "rope_parameters": rope,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": legacy_scaling,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)},
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "pad_token_id": target.get("pad_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eyas_draft_config": asdict(cfg),
    }


def write_draft(folder: Path, state: dict[str, torch.Tensor], cfg: DraftConfig, aux_layer_ids: list[int],
                target: dict[str, Any]) -> None:
    """Write config.json and model.safetensors (each atomically), in the target's dtype."""
    dtype = getattr(torch, str(target.get("torch_dtype") or target.get("dtype") or "float32"))
    write_weights(folder, exported_tensors(state, dtype), hf_config(cfg, aux_layer_ids, target, dtype))


def read_config(folder: Path) -> tuple[DraftConfig, list[int]]:
    cfg = read_config_json(folder)
    return DraftConfig(**cfg["eyas_draft_config"]), list(cfg["eagle_aux_hidden_state_layer_ids"])


def load_draft(folder: Path, model: str | Path) -> tuple[Eagle3Draft, list[int]]:
    """An exported draft as a module (fp32), with the target's embedding read from the target's files."""
    cfg, aux_ids = read_config(folder)
    draft = Eagle3Draft(cfg)
    state = imported_state(load_file(str(Path(folder) / WEIGHTS_FILE)))
    state["embed.weight"] = load_embedding(model)
    if "d2t" not in state:  # the identity map (see exported_tensors)
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    draft.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in state.items()})
    return draft.eval(), aux_ids
