"""The checkpoint the vLLM tests serve: a tiny random-weight Llama, made by vLLM's Python."""

from __future__ import annotations

import subprocess
from pathlib import Path

from prefixpool.deploy.vllm_server import DEFAULT_PYTHON


def make_tiny_llama(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([str(DEFAULT_PYTHON), "-m", "prefixpool.testing.tiny_llama", str(out)], check=True,
                   capture_output=True, timeout=300)
    return out
