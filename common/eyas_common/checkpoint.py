"""A target checkpoint folder, read from its files without loading a weight: its config, where each tensor
is, and how big it is. Every stage reads a target's config.json and safetensors index here.

The config: a multimodal wrapper such as Kimi-K2.5 nests its text model's config (the one whose layers,
width and vocabulary eyas works with) under `text_config` or `language_config`; `text_config()` returns
that one, or the config itself for a plain text model.

The size: the extraction planner and the eval's memory estimate both need it: the stored bytes (the index's
`metadata.total_size` when the checkpoint is sharded, else the sum of the files' headers), the
parameter count, and the share in routed experts (an MoE's active parameters per token are far fewer
than its total). A compressed-tensors checkpoint (Kimi-K2.5's INT4 experts) loads about as stored.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TEXT_CONFIG_KEYS = ("text_config", "language_config")  # where multimodal wrappers nest the text model's config
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class CheckpointSize:
    stored_bytes: int          # bytes of the tensors as stored (headers excluded)
    params: int | None         # parameter count (None when only the index's total size is known)
    expert_params: int | None  # parameters in routed experts (`.experts.` in the name)
    quantized: bool            # a quantization_config (e.g. compressed-tensors INT4): loads about as stored
    config: dict[str, Any]     # config.json (the text model's nested in it for wrappers: see text_config)

    @property
    def text(self) -> dict[str, Any]:
        return text_config(self.config)

    def load_bytes(self, dtype: str) -> int:
        """Bytes the weights take once loaded in `dtype` (float32 / bfloat16 / float16)."""
        if self.quantized or self.params is None:
            return self.stored_bytes
        return self.params * TORCH_BYTES[dtype]

    def active_params(self) -> int | None:
        """Parameters one token runs through: routed experts count only for the ones it is sent to."""
        if self.params is None:
            return None
        t = self.text
        routed, per_token = t.get("n_routed_experts") or 0, t.get("num_experts_per_tok") or 0
        if not routed or not self.expert_params:
            return self.params
        return self.params - self.expert_params + self.expert_params * per_token // routed


def read_config(model: str | Path) -> dict[str, Any]:
    """config.json of the target folder `model`; FileNotFoundError naming the folder when it has none."""
    path = Path(model) / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{model}: no {CONFIG}; --model must be a local checkpoint folder")
    return json.loads(path.read_text())


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: nested in a multimodal wrapper's (TEXT_CONFIG_KEYS), else the config itself."""
    return next((config[k] for k in TEXT_CONFIG_KEYS if isinstance(config.get(k), dict)), config)


def read_text_config(model: str | Path) -> dict[str, Any]:
    """The text model's config of the target folder `model` (see text_config)."""
    return text_config(read_config(model))


def read_index(model: str | Path) -> dict[str, Any] | None:
    """The safetensors index of a sharded checkpoint (`weight_map`: tensor -> file, `metadata.total_size`),
    None for a checkpoint in one file."""
    path = Path(model) / INDEX
    return json.loads(path.read_text()) if path.is_file() else None


def weight_files(model: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from the index when the checkpoint is sharded, else
    from the headers of the folder's *.safetensors."""
    model = Path(model)
    if (index := read_index(model)) is not None:
        return {name: model / file for name, file in index["weight_map"].items()}
    files = sorted(model.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model}: the target must be a local safetensors checkpoint")
    return {name: f for f in files for name in _header_of(f) if name != "__metadata__"}


def _header_of(path: Path) -> dict[str, Any]:
    """read_header, its ValueError naming the file (weight_files reads several)."""
    try:
        return read_header(path)
    except ValueError as e:
        raise ValueError(f"{path}: not a whole safetensors file ({e})") from None


def read_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file (tensor name -> dtype, shape, data_offsets; `__metadata__`), read without
    its tensors. ValueError saying what is wrong when the file is not a whole safetensors file: the header says
    how many bytes the tensors take, so a file cut short is told from a whole one without reading them."""
    size = Path(path).stat().st_size
    with Path(path).open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 0 < n <= size - 8:
            raise ValueError(f"{size:,} bytes, too short for the header its first bytes announce (empty or cut short)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
        need = 8 + n + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"its header is not a safetensors header ({type(e).__name__}: {e})") from None
    if size < need:
        raise ValueError(f"{size:,} bytes, but its header describes {need:,} (cut short)")
    return header


def read_checkpoint_size(model: str | Path) -> CheckpointSize:
    """Sizes of the checkpoint in folder `model`; raises FileNotFoundError naming what is missing."""
    model = Path(model)
    config = read_config(model)
    quantized = bool(config.get("quantization_config") or text_config(config).get("quantization_config"))
    meta = read_index(model)
    files = sorted(model.glob("*.safetensors"))
    if meta is not None:
        names = sorted(set(meta["weight_map"].values()))
        present = [model / n for n in names if (model / n).is_file()]
        if len(present) < len(names):  # a recorded index alone (planning for a checkpoint elsewhere)
            return CheckpointSize(int(meta["metadata"]["total_size"]), None, None, quantized, config)
        files = present
    if not files:
        raise FileNotFoundError(f"{model}: no *.safetensors and no {INDEX}; the target must be a safetensors checkpoint")
    stored = params = experts = 0
    for f in files:
        for name, t in read_header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            stored += t["data_offsets"][1] - t["data_offsets"][0]
            params += n
            experts += n if ".experts." in name else 0
    return CheckpointSize(stored, params, experts, quantized, config)
