#!/usr/bin/env bash
# On a GPU machine, with no build there: the torch-free attention harness (built on any machine with
# nvcc by scripts/build_bwd_bench.sh) run with the default kernels and with each sm90
# warp-specialised option, so that a kernel variant's correctness (the harness checks o, dq, dk, dv
# at seqlen 1024 against an fp32 reference) and speed show in a minute or two. Each run has a hang
# guard; with compute-sanitizer present, a synccheck run of the warp-specialised kernels follows.
#
#   scripts/gpu_harness_check.sh BINARY LOG_DIR
set -uo pipefail
BIN=${1:?usage: scripts/gpu_harness_check.sh BINARY LOG_DIR}
LOG=${2:?usage: scripts/gpu_harness_check.sh BINARY LOG_DIR}
mkdir -p "$LOG"

run() {  # run NAME ENV_ASSIGNMENTS... : the harness at head dims 64 and 128 under these flags
  local name=$1
  shift
  timeout 300 env "$@" "$BIN" 64 128 >"$LOG/$name.log" 2>&1
  local status=$?
  echo "== $name ($*): exit $status$([ $status = 124 ] && echo ' (timed out: a hang?)')"
  grep -E "^check|^\| (fwd|bwd) " "$LOG/$name.log"
}

run unset
run default FLASH_ATTN_SM90_WS=0 FLASH_ATTN_SM90_WS_BWD=0
run ws_forward_mode2 FLASH_ATTN_SM90_WS=2
run ws_forward_mode3 FLASH_ATTN_SM90_WS=3
run ws_backward FLASH_ATTN_SM90_WS_BWD=1

if command -v compute-sanitizer >/dev/null 2>&1; then
  for d in 64 128; do
    timeout 600 env FLASH_ATTN_SM90_WS=3 FLASH_ATTN_SM90_WS_BWD=1 FLASH_BENCH_REPS=1 \
      compute-sanitizer --tool synccheck "$BIN" --one "$d" 1024 >"$LOG/synccheck_d$d.log" 2>&1
    echo "== synccheck d$d: exit $? -- $(grep -E 'ERROR SUMMARY' "$LOG/synccheck_d$d.log")"
  done
else
  echo "== compute-sanitizer not found: no synccheck run"
fi
