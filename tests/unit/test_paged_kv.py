"""vLLM's paged KV <-> pool blocks (prefixpool/vllm_connector/paged_kv.py), and the connector's settings, without vLLM.

The layouts are the two vLLM uses: the CPU backend's [num_blocks, kv_heads,
block_size, 2 * head_dim] and flash attention's [2, num_blocks, block_size,
kv_heads, head_dim]. A block saved from one vLLM cache and loaded into another
at other block ids must arrive bit for bit, and touch nothing else.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from prefixpool.vllm_connector.config import BadConnectorConfig, config_from, kv_transfer_json
from prefixpool.vllm_connector.worker import Claim
from prefixpool.vllm_connector.layer_load import LayerLoad
from prefixpool.vllm_connector.paged_kv import PagedKV, UnsupportedLayout
from prefixpool.store.arena import KVArena

NUM_BLOCKS, BLOCK, HEADS, DIM, LAYERS = 6, 32, 2, 8, 3
LAYOUTS = {"cpu": (NUM_BLOCKS, HEADS, BLOCK, 2 * DIM), "flash": (2, NUM_BLOCKS, BLOCK, HEADS, DIM)}


def caches(shape: tuple[int, ...], seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # layer 10 after layer 9: model order, not text order
    return {f"model.layers.{i * 5}.self_attn.attn": torch.randn(shape, generator=generator).to(device)
            for i in range(LAYERS)}


def block_of(layer: torch.Tensor, layout: str, block_id: int) -> torch.Tensor:
    return layer[block_id] if layout == "cpu" else layer[:, block_id]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocks_saved_from_one_cache_load_bit_for_bit_into_another(layout):
    source, target = caches(LAYOUTS[layout], 1), caches(LAYOUTS[layout], 2)
    before = {name: tensor.clone() for name, tensor in target.items()}
    paged_source, paged_target = PagedKV(source, NUM_BLOCKS, BLOCK), PagedKV(target, NUM_BLOCKS, BLOCK)
    arena = KVArena(paged_source.arena_shape(4), paged_source.dtype)
    assert arena.block_bytes == LAYERS * 2 * BLOCK * HEADS * DIM * 4
    paged_source.save([5, 1], arena, [3, 0])
    paged_target.load(arena, [3, 0], [2, 4])
    for name in source:
        for (src, dst) in [(5, 2), (1, 4)]:
            assert torch.equal(block_of(target[name], layout, dst), block_of(source[name], layout, src))
        for untouched in (0, 1, 3, 5):
            assert torch.equal(block_of(target[name], layout, untouched), block_of(before[name], layout, untouched))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_layer_wise_load_has_each_layer_in_place_once_waited_for_and_all_after_join(layout):
    source, target = caches(LAYOUTS[layout], 1), caches(LAYOUTS[layout], 2)
    paged_source, paged_target = PagedKV(source, NUM_BLOCKS, BLOCK), PagedKV(target, NUM_BLOCKS, BLOCK)
    arena = KVArena(paged_source.arena_shape(4), paged_source.dtype)
    paged_source.save([5, 1], arena, [3, 0])
    names = paged_target.names
    assert names == sorted(source, key=lambda n: int(n.split(".")[2]))  # model order, as vLLM calls the layers
    with concurrent.futures.ThreadPoolExecutor(1) as copier:
        layer_load = LayerLoad(paged_target, arena, [3, 0], [2, 4], copier)
        for name in names:
            layer_load.wait(name)
            assert torch.equal(block_of(target[name], layout, 2), block_of(source[name], layout, 5))
            assert torch.equal(block_of(target[name], layout, 4), block_of(source[name], layout, 1))
        layer_load.wait("not.a.layer")  # vLLM may ask for a layer with nothing to load: no wait, no error
        layer_load.join()
    assert layer_load.waited == set(names) and layer_load.num_layers == LAYERS and layer_load.num_blocks == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (runs on the GPU machine)")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cuda_caches_copy_through_pinned_staging_bit_for_bit(layout):
    source, target = caches(LAYOUTS[layout], 1, "cuda"), caches(LAYOUTS[layout], 2, "cuda")
    before = {name: tensor.clone() for name, tensor in target.items()}
    paged_source, paged_target = PagedKV(source, NUM_BLOCKS, BLOCK), PagedKV(target, NUM_BLOCKS, BLOCK)
    assert paged_target.pinned and paged_target.staging(2).is_pinned()
    arena = KVArena(paged_source.arena_shape(4), paged_source.dtype)
    paged_source.save([5, 1], arena, [3, 0])
    with concurrent.futures.ThreadPoolExecutor(1) as copier:  # the layer-wise path, asynchronous copies
        LayerLoad(paged_target, arena, [3, 0], [2, 4], copier).join()
    torch.cuda.synchronize()
    for name in source:
        for (src, dst) in [(5, 2), (1, 4)]:
            assert torch.equal(block_of(target[name], layout, dst), block_of(source[name], layout, src))
        for untouched in (0, 1, 3, 5):
            assert torch.equal(block_of(target[name], layout, untouched), block_of(before[name], layout, untouched))


def test_a_background_load_is_copied_or_recomputed_never_both():
    claim = Claim()
    assert claim.take("recompute") and not claim.for_copy()  # past the deadline: the late copy must not write
    claim = Claim()
    assert claim.for_copy() and not claim.take("recompute")  # a copy under way: vLLM waits for it
    assert claim.for_copy()


def test_a_cache_without_a_block_dimension_is_refused():
    with pytest.raises(UnsupportedLayout):
        PagedKV({"layer.0": torch.zeros(5, HEADS, BLOCK, 2 * DIM)}, NUM_BLOCKS, BLOCK)
    with pytest.raises(UnsupportedLayout):
        PagedKV({}, NUM_BLOCKS, BLOCK)


def test_settings_reject_unknown_keys_and_wrong_types_and_default_the_node_id():
    assert config_from({}, "0123456789abcdef").node_id.endswith("-01234567")
    assert config_from({"node_id": "a", "pool_blocks": "16"}).pool_blocks == 16
    with pytest.raises(BadConnectorConfig, match="unknown"):
        config_from({"pool_block": 16})
    with pytest.raises(BadConnectorConfig, match="pool_blocks"):
        config_from({"pool_blocks": "many"})
    with pytest.raises(BadConnectorConfig):
        kv_transfer_json({"etcd": "x"})
    assert config_from({"async_load": False}).async_load is False
    with pytest.raises(BadConnectorConfig, match="async_load"):
        config_from({"async_load": "false"})  # a string would read as true
    with pytest.raises(BadConnectorConfig, match="ssd_write_through"):
        config_from({"ssd_write_through": True})  # no SSD tier to write to
