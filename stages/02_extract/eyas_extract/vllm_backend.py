"""The vllm backend: vLLM runs the target, its `extract_hidden_states` method keeps the states.

Each sample goes in as a token prompt with max_tokens=1. vLLM's extract_hidden_states speculative
method stores the residual stream entering each asked-for layer (vLLM counts aux ids like HF's
hidden_states: id k enters layer k, id L leaves the last layer, before the final norm), and our
connector (vllm_connector.py) saves a finished request's rows to a spool file. The final normed
state is the target's own final norm applied to id L (its weights alone are read from the
checkpoint); the top-K teacher comes from vLLM's prompt log-probs. The rows then go through the
same `encode` and shard writer as the hf backend, so the files are the same.

vLLM schedules its own batches (continuous batching, chunked prefill), so `batch_tokens` is its
token budget per step and a shard's bytes may differ in the last bits from an hf run's.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from eyas_common.checkpoint import weight_files
from eyas_common.contract import DatasetError

from eyas_extract.capture import encode, find_parts
from eyas_extract.config import ExtractConfig
from eyas_common.hidden import torch_dtype

CONNECTOR = "EyasHiddenStatesConnector"
CONNECTOR_MODULE = "eyas_extract.vllm_connector"
SPOOL_WAIT_S = 600  # a finished request's file is written after its output returns: wait this long at most


def load_final_norm(cfg: ExtractConfig) -> torch.nn.Module:
    """The target's final norm with its weights, without loading the rest of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.trust_remote_code)
    parts = find_parts(skeleton, cfg.num_layers, cfg.hidden_size)
    prefix = parts.names["norm"]
    wanted = {f"{prefix}.{n}": n for n in parts.norm.state_dict()}
    files = weight_files(cfg.model)
    seen = [k for k in files if k.endswith("norm.weight") and "layers." not in k]
    state: dict[str, torch.Tensor] = {}
    for key in wanted.keys() & files.keys():
        with safe_open(files[key], "pt") as h:
            state[wanted[key]] = h.get_tensor(key)
    if len(state) != len(wanted):
        raise DatasetError(f"{cfg.model}: no weights {sorted(wanted)} for the final norm in its *.safetensors "
                           f"(norm weights outside the layers: {sorted(seen) or 'none'}); use --backend hf")
    norm = parts.norm.to_empty(device="cpu")
    norm.load_state_dict(state)
    return norm.to(torch_dtype(cfg.dtype)).eval()


def _topk(flat: Any, positions: range | list[int], k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Top-K (ids, logprobs) at each position of vLLM flat logprobs, sorted by rank.

    A position lists the scored token (prompt token or sample) with its rank, then ranks 1..K; the
    scored token may repeat one of them, or rank below K and be dropped.
    """
    ids, lps = [], []
    for p in positions:
        s, e = flat.start_indices[p], flat.end_indices[p]
        best: dict[int, tuple[int, float]] = {}
        for tok, lp, rank in zip(flat.token_ids[s:e], flat.logprobs[s:e], flat.ranks[s:e], strict=True):
            if rank is not None and rank <= k:
                best[tok] = (rank, lp)
        top = sorted(best.items(), key=lambda kv: (kv[1][0], -kv[1][1]))[:k]
        if len(top) != k:
            raise RuntimeError(f"vLLM returned {len(top)} log-probs of rank <= {k} at position {p}")
        ids.append([t for t, _ in top])
        lps.append([lp for _, (_, lp) in top])
    return ids, lps


def require_vllm() -> None:
    """Refuse early, before anything is written, when this Python has no vLLM."""
    if importlib.util.find_spec("vllm") is None:
        raise DatasetError("--backend vllm needs vLLM in this Python; run eyas-extract with the Python that has it "
                           "(locally `.venv-vllm/bin/python -m eyas_extract.cli run ...`, which `make extract "
                           "BACKEND=vllm` does), or use --backend hf")


class VLLMBackend:
    def __init__(self, cfg: ExtractConfig, max_len: int):
        from vllm import LLM

        self.cfg = cfg
        # vLLM returns the states in layer order, once per id: ask for the sorted ids, pick ours after.
        ids = sorted(set(cfg.layers) | ({cfg.num_layers} if cfg.teacher == "final" else set()))
        self.pick = [ids.index(k) for k in cfg.layers]
        self.final_at = ids.index(cfg.num_layers) if cfg.teacher == "final" else None
        self.norm = load_final_norm(cfg) if cfg.teacher == "final" else None
        self.spool = Path(tempfile.mkdtemp(prefix="eyas-spool-"))
        self.requests = 0
        on_gpu = torch.cuda.is_available()
        self.llm = LLM(
            model=cfg.model,
            dtype=cfg.dtype,
            trust_remote_code=cfg.trust_remote_code,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_expert_parallel=cfg.enable_expert_parallel,
            max_model_len=max_len + 1,  # the prompt plus the one sampled token
            max_num_batched_tokens=max(cfg.batch_tokens, max_len + 1),
            enable_prefix_caching=False,  # a prefix hit would skip the forward that stores its rows
            enforce_eager=not on_gpu,  # prefill only: on CPU compiling costs more start-up than it saves
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
            kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                                "kv_role": "kv_producer", "kv_connector_extra_config": {"spool": str(self.spool)}},
        )
        for _ in self.extract([[0] * 8], [[0]]):  # the first step pays one-time set-up: not in the shards' time
            pass

    def extract(self, tokens: list[list[int]], batches: list[list[int]]
                ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
        """Per sample: [its index], its stored rows. vLLM batches the whole shard itself."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        keys = [str(self.requests + k) for k in range(len(tokens))]  # unique names in the spool
        self.requests += len(tokens)
        want = self.cfg.topk if self.cfg.teacher == "topk" else None
        params = [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=want, logprobs=want,
                                 flat_logprobs=True, detokenize=False,
                                 extra_args={"kv_transfer_params": {"eyas_key": key}}) for key in keys]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=t) for t in tokens], params, use_tqdm=False)
        for k, out in enumerate(outs):
            hidden = self._spooled(keys[k], tokens[k])
            aux = hidden[:, self.pick]
            if self.cfg.teacher == "final":
                yield [k], encode(self.cfg, aux, self.norm(hidden[:, self.final_at].to(torch_dtype(self.cfg.dtype))))
            else:
                # Prompt log-probs at position t+1 are computed at t; the last row's are the sample's.
                ids, lps = _topk(out.prompt_logprobs, range(1, len(tokens[k])), self.cfg.topk)
                last_ids, last_lps = _topk(out.outputs[0].logprobs, [0], self.cfg.topk)
                topk = (torch.tensor(ids + last_ids, dtype=torch.int32), torch.tensor(lps + last_lps))
                yield [k], encode(self.cfg, aux, topk=topk)

    def _spooled(self, key: str, token_ids: list[int]) -> torch.Tensor:
        path = self.spool / f"{key}.safetensors"
        deadline = time.monotonic() + SPOOL_WAIT_S
        while not path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM's connector never wrote {path}; see the engine log above")
            time.sleep(0.005)
        data = load_file(path)
        path.unlink()
        if data["token_ids"].tolist() != token_ids:
            raise RuntimeError(f"{path}: vLLM's cached tokens differ from the sample's: the rows belong elsewhere")
        return data["hidden_states"]

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.spool, ignore_errors=True)
