#!/usr/bin/env bash
# Install everything, then run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/prefixpool demo "$@"
