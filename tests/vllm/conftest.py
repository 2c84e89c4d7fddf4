"""Fixtures of the vLLM test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.vllm_model import make_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Llama checkpoint, one per test module."""
    return make_tiny_llama(tmp_path_factory)
