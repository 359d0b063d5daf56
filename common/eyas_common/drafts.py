"""The drafts dataset (stage 03 writes it; the servers and stage 04 read it): file names, the draft
folder's writer and reader, the checkpoints' writer and reader, and the checks a reader makes before
trusting a draft folder (check_folder: `eyas-train eval` and `eyas-serve launch` run it first).

`drafts/NAME/` holds:
    config.json        the servers' draft config: LlamaForCausalLMEagle3, one layer, draft/target vocab and
                       widths, aux layer ids (top level and in eagle_config), norm_before_residual
    model.safetensors  fc, midlayer.*, norm, lm_head, d2t, t2d (no embed_tokens: servers take the target's)
    train_log.jsonl    one record per log interval: loss, per-step loss and top-1 accuracy, tokens/s
    training.png       the curves of train_log.jsonl
    checkpoints/       step-NNNNNNNN.pt: model, optimiser, scheduler, step, RNG, data position, config;
                       best.pt: the weights with the best validation so far (what is exported)
    manifest.json      eyas.drafts/1: lineage (hidden + synth datasets), target fingerprint, params, stats
The serving folder is config.json + model.safetensors: exactly what vLLM's and SGLang's
`--speculative-config '{"method": "eagle3", "model": "<drafts/NAME>"}'` load.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from eyas_common.checkpoint import read_header
from eyas_common.contract import REMAKE, Dataset, DatasetError, atomic_output, check_intact, write_json_atomic

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
LOG_FILE, PLOT_FILE, CKPT_DIR = "train_log.jsonl", "training.png", "checkpoints"
BEST_FILE = "best.pt"  # in CKPT_DIR: the draft with the best validation so far (what is exported)
ARCHITECTURE = "LlamaForCausalLMEagle3"
# Keys a server needs from config.json, and their types.
REQUIRED_CONFIG = {"architectures": list, "hidden_size": int, "num_attention_heads": int, "num_key_value_heads": int,
                   "intermediate_size": int, "vocab_size": int, "draft_vocab_size": int, "target_hidden_size": int,
                   "eagle_aux_hidden_state_layer_ids": list, "eagle_config": dict}


# The same for a DFlash draft (docs/interop.md): its vLLM/SGLang loaders read these.
DFLASH_REQUIRED_CONFIG = {"architectures": list, "hidden_size": int, "num_hidden_layers": int,
                          "num_attention_heads": int, "num_key_value_heads": int, "intermediate_size": int,
                          "vocab_size": int, "target_hidden_size": int, "block_size": int, "dflash_config": dict}
# What every refusal of a draft folder's files says to do.
FIX = f"export it again (eyas-train export NAME) or retrain with {REMAKE['drafts']}"


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def checkpoint_paths(folder: Path) -> list[Path]:
    """Checkpoints of a draft folder, oldest first."""
    return sorted((Path(folder) / CKPT_DIR).glob("step-*.pt"))


def write_checkpoint(path: Path, payload: dict[str, Any]) -> Path:
    """A training checkpoint (torch.save of `payload`), atomically. Saved through a Python file object, so that
    a full disk reaches atomic_output as the OSError it is: torch reports its writer's failure as a RuntimeError
    ("unexpected pos"), with the file's own OSError only as that error's context."""
    import torch

    with atomic_output(path) as tmp, open(tmp, "wb") as f:
        try:
            torch.save(payload, f)
        except RuntimeError as e:
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise
    return path


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint as write_checkpoint saved it (the one place checkpoints are read). One that cannot be read
    is refused in one line naming it; checkpoints are only ever renamed into place whole, so such a file was
    damaged on disk afterwards, and the caller adds which checkpoint to use instead (readable_checkpoint)."""
    import torch

    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a damaged file raises EOFError, RuntimeError, UnpicklingError, ...
        why = f"{type(e).__name__}: {str(e).split('. ')[0][:160]}"
        raise DatasetError(f"{path}: unreadable checkpoint ({why}); it was damaged on disk after it was "
                           f"written") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt:
        raise DatasetError(f"{path}: not an eyas checkpoint (no model state in it)")
    return ckpt


def readable_checkpoint(paths: list[Path]) -> Path | None:
    """The newest of `paths` (oldest first) that read_checkpoint reads: what to name in a refusal. Each is read
    whole, so this runs only on the way to a refusal."""
    for path in reversed(paths):
        try:
            read_checkpoint(path)
            return path
        except DatasetError:
            continue
    return None


def write_weights(folder: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """model.safetensors then config.json, each atomically (temp file, fsync, rename)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    with atomic_output(Path(folder) / WEIGHTS_FILE) as tmp:
        try:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        except SafetensorError as e:  # the OS's error (a full disk) is only in its text: "... (os error 28)"
            if not (m := re.search(r"\(os error (\d+)\)", str(e))):
                raise
            raise OSError(int(m[1]), os.strerror(int(m[1]))) from None  # atomic_output names it in one line
    write_json_atomic(Path(folder) / CONFIG_FILE, config)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a draft folder, refused (one line, with the fix) unless a server could load it."""
    path, fix = Path(folder) / CONFIG_FILE, FIX
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing; a draft folder holds {CONFIG_FILE} and {WEIGHTS_FILE}: {fix}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(cfg, dict):
        raise DatasetError(f"{path}: not a JSON object; {fix}")
    dflash = cfg.get("architectures") == [DFLASH_ARCHITECTURE]
    required = DFLASH_REQUIRED_CONFIG if dflash else REQUIRED_CONFIG
    bad = [f"{k} ({t.__name__})" for k, t in required.items() if not isinstance(cfg.get(k), t)]
    if bad:
        raise DatasetError(f"{path}: missing or mistyped keys {', '.join(bad)}; {fix}")
    if not dflash and cfg["architectures"] != [ARCHITECTURE]:
        raise DatasetError(f"{path}: architectures {cfg['architectures']}, expected [{ARCHITECTURE!r}]; {fix}")
    if not (Path(folder) / WEIGHTS_FILE).is_file():
        raise DatasetError(f"{Path(folder) / WEIGHTS_FILE}: missing; {fix}")
    return cfg


DFLASH_ARCHITECTURE = "DFlashDraftModel"  # a DFlash draft folder (docs/interop.md, "DFlash drafts")


def draft_method(folder: Path) -> str:
    """The speculative method a draft folder is served with: "dflash" for a DFlash draft, else "eagle3"
    (read from its config.json's architectures; a folder without one is taken as EAGLE-3, whose reader
    then says what is missing)."""
    try:
        arch = json.loads((Path(folder) / CONFIG_FILE).read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return "eagle3"
    return "dflash" if arch == [DFLASH_ARCHITECTURE] else "eagle3"


# Methods whose format fixes the draft tokens of a step (a DFlash block: the anchor + block_size - 1 masked
# slots its training filled); any other method's K is the server's choice.
_FIXED_SPEC_TOKENS = {"dflash": lambda config: int(config["block_size"]) - 1}


def fixed_spec_tokens(folder: Path) -> int | None:
    """The draft tokens per step the draft's own format fixes, or None where the server picks K (EAGLE-3)."""
    rule = _FIXED_SPEC_TOKENS.get(draft_method(folder))
    return None if rule is None else rule(read_config(folder))


def served_spec_tokens(folder: Path, eagle3: int = 3) -> int:
    """Draft tokens per step a draft is measured at: what its format fixes (fixed_spec_tokens), else `eagle3`."""
    fixed = fixed_spec_tokens(folder)
    return eagle3 if fixed is None else fixed


# ------------------------------------------------------------------------------------------------
# The folder as a whole: what `eyas-train eval` and `eyas-serve launch` check before any expensive work.


def check_folder(ds: Dataset, manifest: dict[str, Any], target: dict[str, Any] | None = None) -> dict[str, Any]:
    """Refuse a complete draft that a server or `eyas-train eval` would fail on (or, worse, load), without loading
    a weight: config.json (read_config), model.safetensors' header against the config's widths and vocabularies,
    the aux layer ids against the layers of `target` (its text config), then the served files against the bytes and
    sha256 its manifest lists (the contract's check_intact). One line names the file, the field and the fix.
    Returns the config."""
    cfg, weights = read_config(ds.path), ds.path / WEIGHTS_FILE
    try:
        header = read_header(weights)
    except (OSError, ValueError) as e:
        raise DatasetError(f"{weights}: not a whole safetensors file ({e}); {FIX}") from None
    _check_shapes(ds.path / CONFIG_FILE, cfg, header)
    _check_own_config(ds.path / CONFIG_FILE, cfg)
    _check_layers(ds.path / CONFIG_FILE, cfg, target)
    differ = target_mismatch(target or {}, cfg)
    if differ:  # another size of the same family shares the tokenizer, so the fingerprint check passed it
        raise DatasetError(f"{ds.ref} was trained for another target ({(manifest.get('target') or {}).get('model')}): "
                           f"this one's config.json has {', '.join(differ)}; pass the target it was trained for "
                           f"(--model), or train a draft for this one (make train)")
    # after the checks above, which name the field where a hash could not; the served files only: the
    # checkpoints beside them can be tens of GB for a large target, and a server never reads them
    check_intact(ds, manifest, {CONFIG_FILE, WEIGHTS_FILE})
    return cfg


def target_mismatch(target: dict[str, Any], draft: dict[str, Any]) -> list[str]:
    """What of a target's (text) config is not what a draft was made for, its width and vocabulary, read from the
    draft's config.json or its manifest's `draft` params (the same keys): e.g. "hidden_size 64 (the draft's: 576)";
    [] where `target` does not say."""
    return [f"{key} {target[key]} (the draft's: {draft[own]})"
            for key, own in (("hidden_size", "target_hidden_size"), ("vocab_size", "vocab_size"))
            if own in draft and key in target and target[key] != draft[own]]


def _aux_ids(path: Path, cfg: dict[str, Any]) -> tuple[str, list[int], list[int]]:
    """(the field, its ids, the same as eyas aux ids) of the target layers the draft reads: EAGLE-3's aux ids;
    DFlash's target_layer_ids count layer outputs (eyas_common.methods: aux id = id + 1)."""
    dflash = cfg["architectures"] == [DFLASH_ARCHITECTURE]
    field = "dflash_config.target_layer_ids" if dflash else "eagle_aux_hidden_state_layer_ids"
    ids = cfg["dflash_config"].get("target_layer_ids") if dflash else cfg["eagle_aux_hidden_state_layer_ids"]
    if not (isinstance(ids, list) and ids and all(type(i) is int for i in ids)):
        raise DatasetError(f"{path}: {field} is {ids!r}, not a list of layer ids; {FIX}")
    return field, ids, [i + 1 for i in ids] if dflash else ids


def _check_own_config(path: Path, cfg: dict[str, Any]) -> None:
    """The servers read config.json's top level, `eyas-train eval` its eyas_draft_config: they must agree."""
    own = cfg.get("eyas_draft_config") if isinstance(cfg.get("eyas_draft_config"), dict) else {}
    field, ids, aux = _aux_ids(path, cfg)
    eagle_cfg = cfg.get("eagle_config")
    eagle = eagle_cfg.get("eagle_aux_hidden_state_layer_ids", ids) if isinstance(eagle_cfg, dict) else ids
    seen = {k: cfg[k] for k in own if k in cfg} | {"num_aux": len(aux), "num_features": len(aux),
                                                   "aux_layer_ids": aux}
    differ = [k for k in own if k in seen and own[k] != seen[k]] + (["eagle_config"] if eagle != ids else [])
    if differ:
        k = differ[0]
        what = (f"eyas_draft_config.{k} is {own[k]!r}, but the top level (what servers read) says {seen[k]!r}"
                if k != "eagle_config" else f"eagle_config's aux layer ids {eagle} differ from {field} {ids}")
        raise DatasetError(f"{path}: {what}; {FIX}")


def _expected_shapes(cfg: dict[str, Any], n_aux: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """Every tensor as the servers build the draft from config.json: name -> its dims, each one as (the config
    field that sets it, its size). EAGLE-3's d2t and t2d are listed; a full vocabulary leaves them out."""
    dflash = cfg["architectures"] == [DFLASH_ARCHITECTURE]
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim") or hidden // max(heads, 1)
    h, ffn = ("hidden_size", hidden), ("intermediate_size", cfg["intermediate_size"])
    q, kvw = ("num_attention_heads x head_dim", heads * hd), ("num_key_value_heads x head_dim", kv * hd)
    x = h if dflash else ("2 x hidden_size", 2 * hidden)  # EAGLE-3's attention reads [embedding ; hidden]
    layer = {"self_attn.q_proj.weight": (q, x), "self_attn.k_proj.weight": (kvw, x),
             "self_attn.v_proj.weight": (kvw, x), "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (ffn, h),
             "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn), "input_layernorm.weight": (h,),
             "post_attention_layernorm.weight": (h,)}
    shapes = {"fc.weight": (h, (f"target_hidden_size x {n_aux} aux layers", cfg["target_hidden_size"] * n_aux)),
              "norm.weight": (h,)}
    if dflash:
        layer |= {"self_attn.q_norm.weight": (("head_dim", hd),), "self_attn.k_norm.weight": (("head_dim", hd),)}
        shapes["hidden_norm.weight"] = (h,)
        return shapes | {f"layers.{i}.{k}": v for i in range(cfg["num_hidden_layers"]) for k, v in layer.items()}
    dv = ("draft_vocab_size", cfg["draft_vocab_size"])
    layer["hidden_norm.weight"] = (h,)
    shapes |= {"lm_head.weight": (dv, h), "d2t": (dv,), "t2d": (("vocab_size", cfg["vocab_size"]),)}
    return shapes | {f"midlayer.{k}": v for k, v in layer.items()}


def _check_shapes(path: Path, cfg: dict[str, Any], header: dict[str, Any]) -> None:
    """model.safetensors holds exactly the tensors config.json describes, each of the shape it says."""
    expected = _expected_shapes(cfg, len(_aux_ids(path, cfg)[2]))
    have = {k: v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    optional = {"d2t", "t2d"} if cfg.get("draft_vocab_size") == cfg["vocab_size"] else set()
    missing, extra = sorted(set(expected) - set(have) - optional), sorted(set(have) - set(expected))
    if missing or extra:
        raise DatasetError(f"{path.with_name(WEIGHTS_FILE)}: its tensors are not the ones {path.name} describes "
                           f"(missing {missing[:3]}, not described {extra[:3]}); {FIX}")
    for name, dims in expected.items():
        shape = have.get(name)
        if shape is not None and list(shape) != [n for _, n in dims]:
            field, size = next(((f, n) for (f, n), s in zip(dims, shape) if n != s), dims[0])
            raise DatasetError(f"{path}: {field} is {size}, but {WEIGHTS_FILE} holds {name} of shape {list(shape)} "
                               f"(expected {[n for _, n in dims]}); {FIX}")


def _check_layers(path: Path, cfg: dict[str, Any], target: dict[str, Any] | None) -> None:
    """The layers the draft reads are layers the target has: ids in [0, num_hidden_layers)."""
    layers = (target or {}).get("num_hidden_layers")
    field, ids, _ = _aux_ids(path, cfg)
    if isinstance(layers, int) and not all(0 <= i < layers for i in ids):
        raise DatasetError(f"{path}: {field} {ids} name layers the target does not have (it has {layers}: ids 0 to "
                           f"{layers - 1}); pass the target the draft was trained for (--model), or {FIX}")

