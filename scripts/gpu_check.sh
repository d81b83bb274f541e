#!/usr/bin/env bash
# Build, test and benchmark on a GPU machine in one call; every log and result lands in LOG_DIR.
#
#   scripts/gpu_check.sh LOG_DIR [WHEEL_DIR]
#
# WHEEL_DIR (optional): wheels to install first on a machine with no registry access
# (nvidia-cutlass, for one); they go to a private folder put on PYTHONPATH.
# Environment (optional):
#   GPU_CHECK_TESTS       pytest targets (default: tests)
#   GPU_CHECK_PYTEST_ARGS extra pytest arguments (default: -x is not used; all tests run)
#   GPU_CHECK_BENCHMARKS  benchmark scripts to run (default: every benchmarks/benchmark_*.py);
#                         "none" runs none
#   GPU_CHECK_BENCH_ARGS  arguments given to every benchmark (e.g. --dims 64,128)
#   GPU_CHECK_SKIP_BUILD  set to 1 to reuse an existing install
#   GPU_CHECK_PYTEST_TIMEOUT, GPU_CHECK_BENCH_TIMEOUT  seconds for the whole pytest run and for each
#                         benchmark (default: no limit)
#   and the build knobs of setup.py (FLASH_ATTN_HDIMS, FLASH_ATTN_DTYPES, MAX_JOBS, ...).
set -uo pipefail

LOG_DIR=${1:?usage: scripts/gpu_check.sh LOG_DIR [WHEEL_DIR]}
WHEEL_DIR=${2:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
SUMMARY="$LOG_DIR/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

cd "$REPO"
export PYTHONUNBUFFERED=1
# The build chooses the host compiler itself (csrc/host_compiler.py); GPU_CHECK_CXX / GPU_CHECK_CC
# override it for an experiment.
if [ -n "${GPU_CHECK_CXX:-}" ]; then
  export CXX=$GPU_CHECK_CXX CC=${GPU_CHECK_CC:-$(dirname "$GPU_CHECK_CXX")/gcc}
fi
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

if [ -n "$WHEEL_DIR" ] && compgen -G "$WHEEL_DIR/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/flash_attn_wheels "$WHEEL_DIR"/*.whl >"$LOG_DIR/wheels.log" 2>&1 \
    || { note "wheel install FAILED (see wheels.log)"; exit 1; }
  export PYTHONPATH=/tmp/flash_attn_wheels${PYTHONPATH:+:$PYTHONPATH}
  note "installed wheels from $WHEEL_DIR: $(cd "$WHEEL_DIR" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')"
elif [ -n "$WHEEL_DIR" ]; then
  note "WARNING: no wheels in $WHEEL_DIR (was it carried to this machine?)"
fi

nvidia-smi >"$LOG_DIR/nvidia-smi.txt" 2>&1
python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" 2>&1 | tee -a "$SUMMARY"

if [ "${GPU_CHECK_SKIP_BUILD:-0}" != 1 ]; then
  start=$(date +%s)
  python3 -m pip install -v --no-build-isolation --no-deps . >"$LOG_DIR/build.log" 2>&1
  status=$?
  note "build: exit $status in $(( $(date +%s) - start )) s with MAX_JOBS=$MAX_JOBS" \
       "(FLASH_ATTN_HDIMS=${FLASH_ATTN_HDIMS:-all} FLASH_ATTN_DTYPES=${FLASH_ATTN_DTYPES:-all})"
  if [ $status -ne 0 ]; then
    grep -E "error|Error" "$LOG_DIR/build.log" | head -40 | tee -a "$SUMMARY"
    exit $status
  fi
  grep -E "registers|spill" "$LOG_DIR/build.log" >"$LOG_DIR/ptxas.txt" || true
  grep -E "^\s*flash_attn:" "$LOG_DIR/build.log" | tee -a "$SUMMARY"
fi
python3 -c "import flash_attn._native as n; print('extensions:', {e: n.extension_available(e) for e in \
('flash_attn_2_cuda', 'fused_dense_lib', 'dropout_layer_norm')})" 2>&1 | tee -a "$SUMMARY"

# shellcheck disable=SC2086
timeout "${GPU_CHECK_PYTEST_TIMEOUT:-0}" python3 -m pytest ${GPU_CHECK_TESTS:-tests} -q -p no:cacheprovider ${GPU_CHECK_PYTEST_ARGS:-} \
  --junitxml="$LOG_DIR/junit.xml" >"$LOG_DIR/pytest.log" 2>&1
note "pytest: exit $? -- $(tail -n 1 "$LOG_DIR/pytest.log")"
grep -E "^(FAILED|ERROR)" "$LOG_DIR/pytest.log" | head -30 | tee -a "$SUMMARY"

benchmarks=${GPU_CHECK_BENCHMARKS:-$(ls benchmarks/benchmark_*.py 2>/dev/null)}
if [ "$benchmarks" != none ]; then
  export FLASH_ATTN_BENCH_OUT="$LOG_DIR"
  for bench in $benchmarks; do
    name=$(basename "$bench" .py)
    start=$(date +%s)
    # shellcheck disable=SC2086
    timeout "${GPU_CHECK_BENCH_TIMEOUT:-0}" python3 "$bench" ${GPU_CHECK_BENCH_ARGS:-} >"$LOG_DIR/$name.log" 2>&1
    note "$name: exit $? in $(( $(date +%s) - start )) s"
    tail -n 40 "$LOG_DIR/$name.log"
  done
fi
note "done; logs in $LOG_DIR"
