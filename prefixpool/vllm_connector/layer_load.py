"""A layer-wise load: pool blocks -> vLLM's paged KV one layer at a time, on a copy thread, under the forward pass.

    start_load_kv          LayerLoad(...): every layer's copy queued on the copy thread, in model order
    attention of layer i   wait(name of layer i): returns once layer i's blocks are in vLLM's cache;
                           the copies of layers i+1... go on while layer i computes
    wait_for_save          join(): every layer copied (the step's saves read vLLM's blocks)

vLLM calls wait_for_layer_load from the attention op itself
(vllm/model_executor/layers/attention/kv_transfer_utils.py:51, the decorator on
unified_attention_with_output in attention.py:766), on the CPU backend too: it
reaches that op through torch.ops (platforms/cpu.py: opaque_attention_op). The
copies write only the loaded blocks, which this step's KV writes (its new
tokens' slots, after the loaded prefix) never touch. Knows nothing of keys,
etcd or the network.
"""

from __future__ import annotations

import concurrent.futures
from typing import Sequence

from prefixpool.vllm_connector.paged_kv import PagedKV
from prefixpool.store.arena import KVArena


class LayerLoad:
    def __init__(self, paged: PagedKV, arena: KVArena, pool_ids: Sequence[int], vllm_ids: Sequence[int],
                 copier: concurrent.futures.Executor) -> None:  # fmt: skip
        assert len(pool_ids) == len(vllm_ids)
        self.num_blocks = len(vllm_ids)
        self._layers = {name: copier.submit(paged.load_layer, index, arena, list(pool_ids), list(vllm_ids))
                        for index, name in enumerate(paged.names)}
        self.waited: set[str] = set()  # layers the forward pass waited for (vLLM called wait_for_layer_load)

    def wait(self, layer_name: str) -> None:
        copy = self._layers.get(layer_name)
        if copy is not None:
            self.waited.add(layer_name)
            copy.result()

    def join(self) -> None:
        for copy in self._layers.values():
            copy.result()

    @property
    def num_layers(self) -> int:
        return len(self._layers)
