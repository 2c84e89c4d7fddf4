"""PrefixPoolConnector: vLLM's KV connector interface (KVConnectorBase_V1) onto the prefixpool pool.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "PrefixPoolConnector",
        "kv_connector_module_path": "prefixpool.vllm_connector.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'

vLLM builds one instance per role: the scheduler's (SchedulerSide: what the
pool can supply, what to load and save each step) and each worker's
(WorkerSide: the pool node itself, copying between vLLM's paged KV and the
pool). `kv_role`: kv_both and kv_producer save what vLLM computes and load
prefixes; kv_consumer (a decode server) only loads. Prefill/decode handoff
(handoff.py): a request that asks it gets the pool and block count back in its
kv_transfer_params, and a request that carries them loads from that pool.
This class only translates vLLM's calls; it is imported inside vLLM's
process (its own venv), so it imports nothing of the router, Ray or our engine.
Multimodal requests and prompts given as embeddings are neither loaded nor saved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole)

from prefixpool.vllm_connector.config import config_from
from prefixpool.vllm_connector.handoff import asks_for_handoff, handoff_of
from prefixpool.vllm_connector.scheduler import LoadOp, SaveOp, SchedulerSide
from prefixpool.vllm_connector.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.02  # at most this long, and only in a step that computes nothing


def _log_like_vllm() -> None:
    """Our modules' INFO lines (loads, fetches) into vLLM's log, through vLLM's own handlers."""
    ours = logging.getLogger("prefixpool.vllm_connector")
    if not ours.handlers:
        ours.setLevel(logging.INFO)
        for handler in logging.getLogger("vllm").handlers:
            ours.addHandler(handler)


@dataclass
class PrefixPoolMetadata(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
    idle: bool = False  # the step computes nothing: vLLM only polls (e.g. for a background load)
    clear: bool = False  # vLLM reset the connector's cache: the pool forgets its blocks before the loads


def _poolable(request: "Request") -> bool:
    return request.prompt_token_ids is not None and not request.mm_features


class PrefixPoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        config = config_from(self._kv_transfer_config.kv_connector_extra_config, self._kv_transfer_config.engine_id)
        model = vllm_config.model_config
        namespace = config.namespace(model.served_model_name, str(model.dtype).removeprefix("torch."),
                                     vllm_config.cache_config.block_size)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a block that fails to load fails its request; "
                        "set it to 'recompute'", self._kv_transfer_config.kv_load_failure_policy)
        self._num_blocks = kv_cache_config.num_blocks
        saves = self._kv_transfer_config.kv_role != "kv_consumer"  # a decode server's KV goes nowhere
        self.scheduler = SchedulerSide(config, namespace, saves) if role == KVConnectorRole.SCHEDULER else None
        self.worker = WorkerSide(config, namespace) if role == KVConnectorRole.WORKER else None
        self._requests: dict[str, "Request"] = {}

    # -- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker.register(kv_caches, self._num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PrefixPoolMetadata)
        if metadata.clear:
            self.worker.clear()
        self.worker.load(metadata.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once the step's KV is written

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PrefixPoolMetadata)
        self.worker.save(metadata.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """In a step with nothing to compute, wait a moment for a background load rather than let
        vLLM's engine loop spin (it would take the GIL from the thread that receives the blocks)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, PrefixPoolMetadata)
        return None, self.worker.finished_loads(IDLE_WAIT_S if metadata.idle else 0.0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid()

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()

    # -- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not _poolable(request):
            return 0, False
        self._requests[request.request_id] = request
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        num = self.scheduler.num_matched(request.request_id, list(request.prompt_token_ids), request.cache_salt,
                                         lora, num_computed_tokens, handoff_of(request.kv_transfer_params))
        return num, bool(num) and self.scheduler.loads_in_background(request.request_id)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.scheduler.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        manager = self._kv_cache_manager

        def block_ids(request_id: str) -> list[int]:
            return manager.get_block_ids(request_id)[0]

        loads, saves = self.scheduler.step(scheduler_output.num_scheduled_tokens, self._requests, block_ids)
        return PrefixPoolMetadata(loads, saves, idle=scheduler_output.total_num_scheduled_tokens == 0,
                                  clear=self.scheduler.take_reset())

    def reset_cache(self) -> bool:
        """`POST /reset_prefix_cache?reset_external=true` (e.g. after a weight update): this server's pool
        forgets every block, in memory, on SSD and in etcd, at the start of vLLM's next step (a load
        planned before it finds nothing and is recomputed)."""
        self.scheduler.reset()
        return True

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Never delays freeing vLLM's blocks: what a decode server needs is in the pool already. A request
        that asked for a handoff gets it in its output's kv_transfer_params."""
        self._requests.pop(request.request_id, None)
        handoff = self.scheduler.handoff(request.request_id) if asks_for_handoff(request.kv_transfer_params) else None
        self.scheduler.finished(request.request_id)
        return False, None if handoff is None else handoff.params()
