#!/usr/bin/env bash
# Install everything, check style, then run the whole test suite (the tests start their own etcd, workers and Ray).
#   bash scripts/test.sh                 # everything (CI)
#   bash scripts/test.sh tests/unit      # the fast loop: no processes, under a minute
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest "$@"
