"""A vLLM KV connector that hands eyas the hidden states vLLM's `extract_hidden_states` caches.

With the `extract_hidden_states` speculative method, vLLM writes the target's aux states of every
token into a cache-only "KV cache" layer ([blocks, n_ids, block_size, H]). This connector, loaded
by vLLM from its module path (`kv_connector_module_path`), copies a finished request's rows out of
that cache and saves them as `<spool>/<key>.safetensors` ({"hidden_states": [T, n_ids, H],
"token_ids": [T]}, renamed into place when complete); eyas's vllm backend turns them into shards.
Unlike vLLM's example connector it pins no memory and uses no CUDA stream, so it runs on the CPU
build too; on a GPU the device-to-host copy is one synchronous gather per finished request, and
the disk write runs in a thread. Only the first tensor-parallel rank writes.

This module runs inside vLLM's engine and worker processes: it imports vLLM and nothing of eyas.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# kv_transfer_params key naming a request's spool file (eyas sets it to the sample id).
KEY = "eyas_key"


@dataclass
class Save:
    req_id: str
    key: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class SaveMeta(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)


class EyasHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        spool = self._kv_transfer_config.get_from_extra_config("spool", None)
        if not spool:
            raise ValueError("EyasHiddenStatesConnector needs kv_connector_extra_config.spool (a folder)")
        self.spool = str(spool)
        self.group = _hidden_states_group(kv_cache_config)
        self._saves: dict[str, Save] = {}       # scheduler: finished requests whose rows await a copy
        self._cache: torch.Tensor | None = None  # worker: the cache-only layer's buffer
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyas-spool")
        self._writes: list[Future] = []
        self._is_writer = True

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store-only: nothing is ever loaded

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = SaveMeta(saves=list(self._saves.values()))
        self._saves.clear()
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.prompt_token_ids is None:
            return False, None
        key = str((request.kv_transfer_params or {}).get(KEY, request.request_id))
        # Only the prompt's rows: the sampled token was never an input, so it has none.
        self._saves[request.request_id] = Save(request.request_id, key, list(request.prompt_token_ids), list(block_ids))
        return True, {"hidden_states_path": os.path.join(self.spool, f"{key}.safetensors")}  # blocks freed once copied

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])

    def get_finished_count(self) -> int:
        return 1  # only the first TP rank reports (and writes)

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._is_writer = get_tensor_model_parallel_rank() == 0
        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise ValueError(f"expected one extract_hidden_states cache layer, found {sorted(layers)}: "
                             f"EyasHiddenStatesConnector needs speculative method extract_hidden_states")
        self._cache = kv_caches[next(iter(layers))]

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # the cache-only layer has already stored the rows; they are read once a request ends

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy each newly finished request's rows to host memory; its blocks can then be freed."""
        if not self._is_writer or not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        done = set()
        for save in meta.saves if isinstance(meta, SaveMeta) else []:
            self._writes.append(self._writer.submit(_write, self.spool, save.key, self._rows(save),
                                                    torch.tensor(save.token_ids, dtype=torch.int64)))
            done.add(save.req_id)
        for f in [f for f in self._writes if f.done()]:
            f.result()  # surface a failed write here, in the engine's log, rather than as a missing file
            self._writes.remove(f)
        return done or None, None

    def _rows(self, save: Save) -> torch.Tensor:
        """[T, n_ids, H] on the host, gathered through the request's blocks."""
        assert self._cache is not None
        block = self._cache.shape[2]
        slots = (torch.tensor(save.block_ids, dtype=torch.int64)[:, None] * block
                 + torch.arange(block, dtype=torch.int64)).flatten()[: len(save.token_ids)]
        slots = slots.to(self._cache.device)
        return self._cache[slots // block, :, slots % block].to("cpu")

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # one token's states contiguous, as the cache-only layer writes them


def _hidden_states_group(kv_cache_config: "KVCacheConfig | None") -> int:
    """Index of the KV cache group that holds the extracted hidden states."""
    if kv_cache_config is None:
        return 0
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    groups = kv_cache_config.kv_cache_groups
    ids = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    return ids[0] if len(ids) == 1 else 0


def _write(spool: str, key: str, hidden: torch.Tensor, token_ids: torch.Tensor) -> None:
    path = os.path.join(spool, f"{key}.safetensors")
    tmp = os.path.join(spool, f".{key}.tmp-{os.getpid()}")
    save_file({"hidden_states": hidden.contiguous(), "token_ids": token_ids}, tmp)
    os.replace(tmp, path)
