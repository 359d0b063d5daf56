"""The DFlash draft folder vLLM and SGLang load (docs/interop.md, "DFlash drafts"), from dflash.py's module
and back.

The weight names go through `exported_name`, the one place that ties DFlashDraft's names to the servers'
(vLLM's DFlashQwen3ForCausalLM.load_weights, SGLang's DFlashDraftModel.load_weights). The target's
embedding and lm_head are never written: both servers share the target's own.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eyas_common.drafts import CONFIG_FILE, WEIGHTS_FILE, write_weights
from eyas_common.methods import to_dflash_ids
from eyas_train.dflash import DFlashConfig, DFlashDraft
from eyas_train.target import load_embedding, load_lm_head

ARCHITECTURE = "DFlashDraftModel"

# Whole-name maps (outside the layers) and per-layer suffix maps: internal -> exported.
TOP_LEVEL: dict[str, str] = {"fc.weight": "fc.weight", "hidden_norm.weight": "hidden_norm.weight",
                             "norm.weight": "norm.weight"}
PER_LAYER: dict[str, str] = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
# Kept out of the file: the target's own tensors, which the servers take from the target.
NOT_EXPORTED = frozenset({"embed.weight", "lm_head.weight"})
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def exported_name(name: str) -> str:
    """Internal name (DFlashDraft.state_dict) -> exported name; KeyError for a name the maps do not know."""
    if name in TOP_LEVEL:
        return TOP_LEVEL[name]
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in PER_LAYER:
        return f"layers.{m.group(1)}.{PER_LAYER[m.group(2)]}"
    raise KeyError(name)


def exported_tensors(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Internal state dict -> exported tensors in `dtype`; refuses a name the maps do not know."""
    unknown = []
    out = {}
    for name, t in state.items():
        if name in NOT_EXPORTED:
            continue
        try:
            out[exported_name(name)] = t.detach().cpu().to(dtype).contiguous()
        except KeyError:
            unknown.append(name)
    if unknown:
        raise KeyError(f"DFlash draft state has names the export does not map: {sorted(unknown)}")
    return out


def imported_state(tensors: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """Exported tensors -> internal names, for loading a draft back."""
    back = {v: k for k, v in TOP_LEVEL.items()}
    back.update({f"layers.{i}.{v}": f"layers.{i}.{k}" for i in range(num_layers) for k, v in PER_LAYER.items()})
    unknown = sorted(set(tensors) - set(back))
    if unknown:
        raise KeyError(f"unexpected tensors in the DFlash draft file: {unknown}")
    return {back[k]: v for k, v in tensors.items()}


def _rope_keys(cfg: DFlashConfig) -> dict[str, Any]:
    rope = dict(cfg.rope_parameters)
    # transformers 5 reads rope_parameters; older readers (SGLang images) read rope_theta / rope_scaling.
    return {"rope_parameters": rope, "rope_theta": rope["rope_theta"],
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope}


def hf_config(cfg: DFlashConfig, aux_layer_ids: list[int], target: dict[str, Any], dtype: torch.dtype,
              mask_token: str | None) -> dict[str, Any]:
    """config.json for the servers: a Qwen3-shaped config plus the DFlash keys (no `layer_types`: every
    layer full, non-causal attention; no `eagle_config`: vLLM would read its aux ids instead)."""
    dflash = {"target_layer_ids": to_dflash_ids(aux_layer_ids), "mask_token_id": cfg.mask_token_id,
              "block_size": cfg.block_size, "use_aux_hidden_state": True}
    if mask_token:
        dflash["mask_token"] = mask_token
    return {
        "architectures": [ARCHITECTURE], "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        **_rope_keys(cfg),
        "attention_bias": False, "tie_word_embeddings": False, "vocab_size": cfg.vocab_size,
        "target_hidden_size": cfg.target_hidden_size, "num_target_layers": target.get("num_hidden_layers"),
        "block_size": cfg.block_size, "dflash_config": dflash,
        "bos_token_id": target.get("bos_token_id"), "eos_token_id": target.get("eos_token_id"),
        "pad_token_id": target.get("pad_token_id"), "torch_dtype": str(dtype).removeprefix("torch."),
        "eyas_draft_config": {**asdict(cfg), "method": "dflash", "aux_layer_ids": list(aux_layer_ids)},
    }


def write_dflash_draft(folder: Path, state: dict[str, torch.Tensor], cfg: DFlashConfig, aux_layer_ids: list[int],
                       target: dict[str, Any], mask_token: str | None = None) -> None:
    """Write config.json and model.safetensors (each atomically), in the target's dtype."""
    dtype = getattr(torch, str(target.get("torch_dtype") or target.get("dtype") or "float32"))
    write_weights(folder, exported_tensors(state, dtype), hf_config(cfg, aux_layer_ids, target, dtype, mask_token))


def read_dflash_config(folder: Path) -> tuple[DFlashConfig, list[int]]:
    """The shape and aux ids an eyas DFlash export was written with."""
    import json

    raw = json.loads((Path(folder) / CONFIG_FILE).read_text())["eyas_draft_config"]
    fields = set(DFlashConfig.__dataclass_fields__)
    return DFlashConfig(**{k: v for k, v in raw.items() if k in fields}), list(raw["aux_layer_ids"])


def load_dflash_draft(folder: Path, model: str | Path) -> tuple[DFlashDraft, list[int]]:
    """An exported draft as a module (fp32), with the target's embedding and lm_head from the target's files."""
    cfg, aux_ids = read_dflash_config(folder)
    draft = DFlashDraft(cfg)
    state = imported_state(load_file(str(Path(folder) / WEIGHTS_FILE)), cfg.num_hidden_layers)
    state["embed.weight"], state["lm_head.weight"] = load_embedding(model), load_lm_head(model)
    draft.load_state_dict({k: v.float() for k, v in state.items()})
    return draft.eval(), aux_ids


def reexport(folder: Path, state: dict[str, torch.Tensor], params: dict[str, Any], target: dict[str, Any]) -> None:
    """`eyas-train export` of a DFlash checkpoint: the draft's shape and layers from the manifest's params, the
    token ids and dtype from the target's (text) config."""
    write_dflash_draft(folder, state, DFlashConfig(**params["draft"]), params["aux_layers"], target)
