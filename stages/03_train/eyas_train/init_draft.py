"""Starting a run from an existing EAGLE-3 draft (`eyas-train run --init-draft PATH`).

Three layouts are read back, the inverse of what export.py writes and of what the servers load:
    eyas         config.json with `eyas_draft_config`; `midlayer.*` names (export.NAME_MAP)
    specforge    config.json `LlamaForCausalLMEagle3` without it; `midlayer.*`, often `embed_tokens.weight`
    speculators  config.json with `speculators_model_type: eagle3` and `transformer_layer_config`
                 (vLLM's speculators format); `layers.0.*` names
`d2t` / `t2d` are read back (absent: the identity map, when the draft vocabulary is the target's); an
`embed_tokens.weight` is dropped, since the draft always reads the target's own embedding.
The draft vocabulary is kept (the new data's coverage under it is reported), or remapped to the new
data's most frequent tokens, keeping the lm_head rows of the tokens in both (what is lost is reported).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from eyas_common.contract import DatasetError, json_type, open_input
from eyas_common.drafts import CONFIG_FILE
from eyas_train.export import NAME_MAP, imported_state
from eyas_train.model import DraftConfig, Eagle3Draft
from eyas_train.vocab import VocabMap, build_vocab

VOCAB_MODES = ("keep", "remap")
# Settings of other trainers that change the draft's computation and that this draft does not have.
UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass
class InitDraft:
    source: str                         # the folder read
    layout: str                         # eyas | specforge | speculators
    cfg: DraftConfig
    aux_layers: list[int] | None        # None when the checkpoint does not record them
    state: dict[str, torch.Tensor]      # internal names (Eagle3Draft), d2t and t2d included; no embed


def resolve(path: str, data_root: Path | None) -> Path:
    """A folder as given, else a drafts/NAME dataset (refused when partial)."""
    folder = Path(path).expanduser()
    if folder.is_dir():
        return folder
    if path.startswith(("/", ".", "~")):
        what = "a file, not a folder" if folder.exists() else "no such folder"
        raise DatasetError(f"--init-draft {path}: {what}; give a draft folder or drafts/NAME under EYAS_DATA")
    try:
        ds, _ = open_input(path if "/" in path else f"drafts/{path}", "drafts", root=data_root)
    except DatasetError as e:
        raise DatasetError(f"--init-draft {path}: {e.message}") from None
    return ds.path


def read_init_draft(path: str, data_root: Path | None = None) -> InitDraft:
    folder = resolve(path, data_root)
    cfg_path = folder / CONFIG_FILE
    if not cfg_path.is_file():
        raise DatasetError(f"--init-draft {path}: no {CONFIG_FILE} in {folder}; expected an EAGLE-3 draft folder")
    try:
        config = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"--init-draft {path}: {cfg_path} is not valid JSON ({e}); expected an EAGLE-3 draft "
                           f"folder's config.json") from None
    if not isinstance(config, dict):
        raise DatasetError(f"--init-draft {path}: {cfg_path} holds a JSON {json_type(config)}, not an object; "
                           f"expected an EAGLE-3 draft folder's config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise DatasetError(f"--init-draft {path}: no *.safetensors in {folder} (pytorch_model.bin is not read: "
                           f"convert it to safetensors first)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise DatasetError(f"--init-draft {path}: {f} is not a readable safetensors file ({e}); copy the "
                               f"draft folder again") from None
    layout = ("eyas" if "eyas_draft_config" in config else
              "speculators" if config.get("speculators_model_type") == "eagle3" else "specforge")
    bad = [k for k in UNSUPPORTED if config.get(k)]
    if bad:
        raise DatasetError(f"--init-draft {path}: {', '.join(bad)} set in {cfg_path}; this trainer's draft has no "
                           f"such norm, so the weights would compute something else")
    tensors.pop("embed_tokens.weight", None)
    renamed = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v for k, v in tensors.items()}
    try:
        state = imported_state(renamed)
    except KeyError as e:
        raise DatasetError(f"--init-draft {path}: {e.args[0]} ({layout} layout read from {folder})") from None
    missing = sorted(set(NAME_MAP) - set(state) - {"d2t", "t2d"})
    if missing:
        more = f" (and {len(missing) - 4} more)" if len(missing) > 4 else ""
        raise DatasetError(f"--init-draft {path}: no {', '.join(NAME_MAP[k] for k in missing[:4])}{more} in "
                           f"{', '.join(f.name for f in files)}; expected a whole EAGLE-3 draft ({layout} layout)")
    try:
        cfg = _draft_config(config, layout, state)
    except KeyError as e:
        raise DatasetError(f"--init-draft {path}: {cfg_path} has no {e.args[0]!r}, which the {layout} layout needs; "
                           f"expected an EAGLE-3 draft folder's config.json") from None
    except TypeError as e:  # eyas_draft_config with a field DraftConfig does not have, or without one it needs
        raise DatasetError(f"--init-draft {path}: {cfg_path}: eyas_draft_config is not this eyas's draft config "
                           f"({str(e).split(') ', 1)[-1]}); export the draft again with this eyas "
                           f"(eyas-train export NAME)") from None
    _check_shapes(state, cfg, path, cfg_path)
    _vocab_maps(state, cfg, path)
    return InitDraft(str(folder), layout, cfg, _aux_ids(config), state)


def _check_shapes(state: dict[str, torch.Tensor], cfg: DraftConfig, path: str, cfg_path: Path) -> None:
    """The tensors have the shapes the config describes (a draft built from it on the meta device, no memory)."""
    with torch.device("meta"):
        own = Eagle3Draft(cfg).state_dict()
    wrong = [f"{NAME_MAP[k]} {list(t.shape)} (config: {list(own[k].shape)})" for k, t in state.items()
             if k in own and k not in ("d2t", "t2d") and t.shape != own[k].shape]
    if wrong:
        raise DatasetError(f"--init-draft {path}: its tensors do not have the shapes {cfg_path} describes: "
                           f"{'; '.join(wrong[:3])}" + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))


def _aux_ids(config: dict[str, Any]) -> list[int] | None:
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def _draft_config(config: dict[str, Any], layout: str, state: dict[str, torch.Tensor]) -> DraftConfig:
    if layout == "eyas":
        return DraftConfig(**config["eyas_draft_config"])
    layer = config.get("transformer_layer_config", config) if layout == "speculators" else config
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    target_hidden = config.get("target_hidden_size") or layer.get("target_hidden_size") or hidden
    rope = dict(layer.get("rope_parameters") or layer.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", layer.get("rope_theta", 10000.0))
    # vLLM reads a speculators config's norm_before_residual as True when absent; SpecForge's as False.
    nbr = config.get("norm_before_residual", layer.get("norm_before_residual", layout == "speculators"))
    return DraftConfig(
        vocab_size=layer["vocab_size"], draft_vocab_size=state["lm_head.weight"].shape[0], hidden_size=hidden,
        target_hidden_size=target_hidden, num_aux=state["fc.weight"].shape[1] // target_hidden,
        num_attention_heads=heads, num_key_value_heads=layer.get("num_key_value_heads", heads),
        head_dim=layer.get("head_dim") or hidden // heads, intermediate_size=layer["intermediate_size"],
        rms_norm_eps=layer.get("rms_norm_eps", 1e-6), max_position_embeddings=layer.get("max_position_embeddings", 4096),
        rope_parameters=rope, norm_before_residual=bool(nbr))


def _vocab_maps(state: dict[str, torch.Tensor], cfg: DraftConfig, path: str) -> None:
    """d2t / t2d as the draft holds them: the identity map when absent, t2d rebuilt from d2t if missing."""
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise DatasetError(f"--init-draft {path}: no d2t, but its draft vocabulary ({cfg.draft_vocab_size}) is "
                               f"not the target's ({cfg.vocab_size}); the map to target ids is missing")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    state["d2t"] = state["d2t"].long()
    if "t2d" not in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + state["d2t"]] = True
        state["t2d"] = t2d
    state["t2d"] = state["t2d"].bool()


def check_fits(init: InitDraft, *, vocab_size: int, hidden_size: int, aux_layers: list[int]) -> None:
    """Refuse a draft made for another target or other aux layers, naming what differs."""
    c = init.cfg
    wrong = [f"{k} {a} (the target's: {b})" for k, a, b in (
        ("vocab_size", c.vocab_size, vocab_size), ("target_hidden_size", c.target_hidden_size, hidden_size),
        ("num_aux", c.num_aux, len(aux_layers))) if a != b]
    if init.aux_layers is not None and init.aux_layers != list(aux_layers):
        wrong.append(f"aux layers {init.aux_layers} (the hidden dataset's: {aux_layers})")
    if wrong:
        raise DatasetError(f"--init-draft {init.source} ({init.layout} layout) does not fit: {'; '.join(wrong)}. "
                           f"Start from a draft of this target, or extract with its --layers")


def init_vocab(init: InitDraft, counts: torch.Tensor, mode: str, draft_vocab: int) -> tuple[VocabMap, str]:
    """The run's vocabulary and a one-line report: the init draft's (keep), or rebuilt from `counts` (remap)."""
    total = int(counts.sum()) or 1
    old = VocabMap(init.state["d2t"], init.state["t2d"], float(counts[init.state["t2d"]].sum()) / total,
                   int((counts > 0).sum()))
    if mode == "keep":
        return old, (f"kept the init draft's vocabulary ({old.d2t.numel()} tokens): it covers {old.coverage:.2%} of "
                     f"this data's masked tokens")
    new = build_vocab(counts, draft_vocab)
    both = int((new.t2d & old.t2d).sum())
    return new, (f"remapped the vocabulary to {new.d2t.numel()} tokens covering {new.coverage:.2%} (the init draft's "
                 f"covered {old.coverage:.2%}); {both} lm_head rows carried over, {new.d2t.numel() - both} start "
                 f"from the target's lm_head, {old.d2t.numel() - both} dropped")


def run_config(init: InitDraft, vocab: VocabMap) -> DraftConfig:
    return replace(init.cfg, draft_vocab_size=vocab.d2t.numel())


@torch.no_grad()
def load_into(draft: Eagle3Draft, init: InitDraft, vocab: VocabMap) -> None:
    """Copy the init draft's weights into `draft` (already set up from the target); lm_head rows by token."""
    own = draft.state_dict()
    for name, t in init.state.items():
        if name in ("d2t", "t2d", "lm_head.weight"):
            continue
        own[name].copy_(t)
    old_rows = torch.full((init.cfg.vocab_size,), -1, dtype=torch.long)
    old_rows[torch.arange(init.state["d2t"].numel()) + init.state["d2t"]] = torch.arange(init.state["d2t"].numel())
    rows = old_rows[vocab.draft_to_target]
    kept = rows >= 0
    draft.lm_head.weight[kept] = init.state["lm_head.weight"][rows[kept]].to(draft.lm_head.weight.dtype)
