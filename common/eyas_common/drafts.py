"""The drafts dataset (stage 03 writes it; the servers and stage 04 read it): file names, the draft
folder's writer and reader, and the checks a reader makes before trusting it.

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
from pathlib import Path
from typing import Any

from eyas_common.contract import REMAKE, DatasetError, atomic_output, write_json_atomic

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


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}.pt"


def checkpoint_paths(folder: Path) -> list[Path]:
    """Checkpoints of a draft folder, oldest first."""
    return sorted((Path(folder) / CKPT_DIR).glob("step-*.pt"))


def write_weights(folder: Path, tensors: dict[str, Any], config: dict[str, Any]) -> None:
    """model.safetensors then config.json, each atomically (temp file, fsync, rename)."""
    from safetensors.torch import save_file

    with atomic_output(Path(folder) / WEIGHTS_FILE) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json_atomic(Path(folder) / CONFIG_FILE, config)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a draft folder, refused (one line, with the fix) unless a server could load it."""
    path = Path(folder) / CONFIG_FILE
    fix = f"export it again (eyas-train export) or retrain with {REMAKE['drafts']}"
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


def served_spec_tokens(folder: Path, eagle3: int = 3) -> int:
    """Draft tokens per step a draft is measured at: a DFlash draft its block size - 1 (the block its training
    filled; vLLM runs K + 1 queries), an EAGLE-3 draft `eagle3`."""
    return int(read_config(folder)["block_size"]) - 1 if draft_method(folder) == "dflash" else eagle3
