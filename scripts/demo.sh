#!/usr/bin/env bash
# Install everything, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM="${VLLM:-0}" bash scripts/install.sh  # the demo runs our own workers: no vLLM venv needed
exec .venv/bin/prefixpool demo "$@"
