"""The torch dtype and device a setting names: where the engine turns model_config's names into torch's.

    "float32" | "bfloat16" | "float16"  <->  torch.float32 | torch.bfloat16 | torch.float16
    "auto" -> cuda when present, else cpu

Only processes that hold weights import this (and torch); configs and the
router keep dtypes as names. Knows nothing of models or arenas.
"""

from __future__ import annotations

import torch

from prefixpool.model.config import DTYPE_BYTES, ConfigError

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
assert DTYPES.keys() == DTYPE_BYTES.keys()


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"unsupported dtype {name!r}; use one of {', '.join(DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` is CUDA when present, else CPU; anything else is passed to torch."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
