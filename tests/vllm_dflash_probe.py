"""Run by .venv-vllm's Python (tests/test_train_dflash.py): vLLM's own config and loader code read an eyas
DFlash export. Prints one JSON object: what vLLM resolved from the draft's config.json, and for every weight
vLLM's model class holds after its load_weights, whether it equals what eyas wrote.

    python vllm_dflash_probe.py TARGET_DIR DRAFT_DIR NUM_SPECULATIVE_TOKENS
"""

from __future__ import annotations

import json
import sys

import torch
from safetensors.torch import load_file


def engine_config(target: str, draft: str, k: int):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=target, dtype="float32", max_model_len=512, enforce_eager=True,
                      speculative_config={"method": "dflash", "model": draft, "num_speculative_tokens": k})
    return args.create_engine_config()


def build_draft(vllm_config):
    """The draft model class vLLM's registry picks for the config, built the way the proposer builds it."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.registry import ModelRegistry

    draft_config = vllm_config.speculative_config.draft_model_config
    cls, arch = ModelRegistry.resolve_model_cls(draft_config.hf_config.architectures, model_config=draft_config)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:0", backend="gloo")
        initialize_model_parallel(1, 1)
        return cls(vllm_config=vllm_config), arch


def expected(name: str, tensors: dict[str, torch.Tensor], q: int, kv: int) -> torch.Tensor | None:
    """What vLLM's parameter `name` should hold, built from eyas's tensors (q/k/v and gate/up are stacked)."""
    if name.endswith("qkv_proj.weight"):
        base = name.removeprefix("model.").removesuffix("qkv_proj.weight")
        return torch.cat([tensors[base + p + "_proj.weight"] for p in "qkv"])
    if name.endswith("gate_up_proj.weight"):
        base = name.removeprefix("model.").removesuffix("gate_up_proj.weight")
        return torch.cat([tensors[base + "gate_proj.weight"], tensors[base + "up_proj.weight"]])
    return tensors.get(name.removeprefix("model."))


def main(target: str, draft: str, k: int) -> dict:
    vllm_config = engine_config(target, draft, k)
    spec = vllm_config.speculative_config
    model, arch = build_draft(vllm_config)
    tensors = load_file(f"{draft}/model.safetensors")
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    compared = {}
    for name, p in params.items():
        want = expected(name, tensors, 0, 0)
        if want is not None:
            compared[name] = bool(torch.equal(p.detach().cpu(), want.to(p.dtype)))
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    hf = spec.draft_model_config.hf_config
    return {"method": spec.method, "architecture": arch, "class": type(model).__name__,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "aux_layers": list(get_eagle3_aux_layers_from_config(spec) or []),
            "mask_token_id": model.model.mask_token_id, "non_causal": dflash_has_any_non_causal(hf),
            "fc_in": model.model.fc.input_size, "own_lm_head": bool(getattr(model, "has_own_lm_head", False)),
            "own_embed": bool(getattr(model, "has_own_embed_tokens", False)),
            "layers": len(model.model.layers), "compared": compared,
            "unloaded": sorted(n for n in params if n not in compared)}


if __name__ == "__main__":
    print("PROBE " + json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
