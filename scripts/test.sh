#!/usr/bin/env bash
# Install everything, then run the whole test suite (the tests start their own etcd, workers and Ray).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
