"""How big a target checkpoint is, read from its safetensors files without loading a weight.

The extraction planner and the eval's memory estimate both need it: the stored bytes (the index's
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

INDEX = "model.safetensors.index.json"
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class CheckpointSize:
    stored_bytes: int          # bytes of the tensors as stored (headers excluded)
    params: int | None         # parameter count (None when only the index's total size is known)
    expert_params: int | None  # parameters in routed experts (`.experts.` in the name)
    quantized: bool            # a quantization_config (e.g. compressed-tensors INT4): loads about as stored
    config: dict[str, Any]     # config.json (the text model's under `text_config` for wrappers)

    @property
    def text(self) -> dict[str, Any]:
        return self.config.get("text_config", self.config)

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


def _header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def read_checkpoint_size(model: str | Path) -> CheckpointSize:
    """Sizes of the checkpoint in folder `model`; raises FileNotFoundError naming what is missing."""
    model = Path(model)
    cfg_path = model / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{model}: no config.json; --model must be a local checkpoint folder")
    config = json.loads(cfg_path.read_text())
    quantized = bool(config.get("quantization_config") or config.get("text_config", {}).get("quantization_config"))
    index = model / INDEX
    files = sorted(model.glob("*.safetensors"))
    if index.is_file():
        meta = json.loads(index.read_text())
        names = sorted(set(meta["weight_map"].values()))
        present = [model / n for n in names if (model / n).is_file()]
        if len(present) < len(names):  # a recorded index alone (planning for a checkpoint elsewhere)
            return CheckpointSize(int(meta["metadata"]["total_size"]), None, None, quantized, config)
        files = present
    if not files:
        raise FileNotFoundError(f"{model}: no *.safetensors and no {INDEX}; the target must be a safetensors checkpoint")
    stored = params = experts = 0
    for f in files:
        for name, t in _header(f).items():
            if name == "__metadata__":
                continue
            n = 1
            for d in t["shape"]:
                n *= d
            stored += t["data_offsets"][1] - t["data_offsets"][0]
            params += n
            experts += n if ".experts." in name else 0
    return CheckpointSize(stored, params, experts, quantized, config)
