"""A vLLM server's KV cache in absolute terms: a block count and bytes, never a fraction of some memory.

    kv_flags(model_path, block_size, dtype, num_blocks=160)   # ["--num-gpu-blocks-override", "160",
                                                              #  "--kv-cache-memory-bytes", "5242880"]
    one block = layers x 2 (K, V) x block_size x kv_heads x head_dim x dtype bytes   (the model's config.json)

vLLM's `--gpu-memory-utilization` is a fraction of the device's memory; on the CPU backend, of NUMA
node 0's, which on some VMs is half the RAM: one fraction gives every machine a different cache, and
0.05 left -0.06 GiB for KV on one of them (vLLM refused to start). `--kv-cache-memory-bytes` is
absolute and read by both backends (vLLM then ignores the fraction); `--num-gpu-blocks-override` fixes
the block count. `VLLM_CPU_KVCACHE_SPACE`, the CPU backend's legacy setting in whole GiB, overrides the
exact bytes when set, so a server's environment leaves it out (`without_kv_space`).
Knows nothing of processes or of vLLM beyond its flags.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from prefixpool.model.config import DTYPE_BYTES as MODEL_DTYPE_BYTES

KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
DTYPE_BYTES = {**MODEL_DTYPE_BYTES, "float": 4, "half": 2}  # ours and vLLM's aliases of them
DEFAULT_DTYPE_BYTES = 2  # "auto" with no dtype in config.json: vLLM's own default then is the checkpoint's 16 bits


class KvSizeUnknown(ValueError):
    """The bytes of one KV block cannot be read from the model's config.json: give the bytes instead."""


def _text_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise KvSizeUnknown(f"cannot size vLLM's KV cache by blocks: {path} is unreadable ({err}); "
                            "give its size in bytes (--vllm-kv-gib, VllmConfig.kv_cache_bytes)") from err
    return hf.get("text_config") or hf  # multimodal checkpoints nest the decoder's fields


def _dtype_bytes(dtype: str, hf: Mapping[str, Any]) -> int:
    if dtype == "auto":
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "")
        return DTYPE_BYTES.get(dtype, DEFAULT_DTYPE_BYTES)
    if dtype not in DTYPE_BYTES:
        raise KvSizeUnknown(f"no KV size known for dtype {dtype!r}; one of {sorted(DTYPE_BYTES)} or auto")
    return DTYPE_BYTES[dtype]


def block_bytes(model_path: str, block_size: int, dtype: str) -> int:
    """The bytes of one KV block of `block_size` tokens, all layers, keys and values."""
    hf = _text_config(model_path)
    try:
        num_layers, num_heads = int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or int(hf["hidden_size"]) // num_heads)
    except (KeyError, TypeError, ValueError) as err:
        raise KvSizeUnknown(f"cannot size vLLM's KV cache by blocks: {model_path}/config.json lacks {err}; "
                            "give its size in bytes") from err
    return num_layers * 2 * block_size * num_kv_heads * head_dim * _dtype_bytes(dtype, hf)


def kv_flags(model_path: str, block_size: int, dtype: str, num_blocks: int | None = None,
             kv_cache_bytes: int | None = None) -> list[str]:
    """vLLM's flags for a cache of `num_blocks` blocks (their bytes from config.json unless given) or of
    `kv_cache_bytes` bytes (as many blocks as fit)."""
    if num_blocks is None and kv_cache_bytes is None:
        raise ValueError("size vLLM's KV cache by blocks or by bytes")
    flags = [] if num_blocks is None else ["--num-gpu-blocks-override", str(num_blocks)]
    if kv_cache_bytes is None:
        assert num_blocks is not None
        kv_cache_bytes = num_blocks * block_bytes(model_path, block_size, dtype)
    return flags + ["--kv-cache-memory-bytes", str(kv_cache_bytes)]


def without_kv_space(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the legacy whole-GiB KV setting, which would override --kv-cache-memory-bytes."""
    return {name: value for name, value in env.items() if name != KV_SPACE_ENV}
