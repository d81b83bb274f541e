#!/usr/bin/env bash
# On a GPU machine: kernel variants side by side. Each harness binary (scripts/build_bwd_bench.sh,
# one per variant source tree) runs with the key-block backward (FLASH_ATTN_SM90_WS_BWD=0) and the
# warp-specialised one (=1), RUNS times in turn, so that variants are timed back to back on the
# same machine. One line per run: the backward's TFLOP/s, per head dim unmasked then causal at
# s1k / s2k / s4k / s16k, and how many of its fp32 checks passed. With SANITIZE=1, synccheck and
# memcheck of each binary's warp-specialised backward follow.
#
#   HDIMS="64 128" RUNS=2 scripts/gpu_harness_compare.sh LOG_DIR BINARY...
set -uo pipefail
LOG=${1:?usage: scripts/gpu_harness_compare.sh LOG_DIR BINARY...}
shift
[ $# -gt 0 ] || { echo "usage: scripts/gpu_harness_compare.sh LOG_DIR BINARY..." >&2; exit 2; }
mkdir -p "$LOG"
read -r -a hdims <<<"${HDIMS:-64 128}"

for run in $(seq "${RUNS:-2}"); do
  for bin in "$@"; do
    for flag in 0 1; do
      out="$LOG/$(basename "$bin")_ws$flag.run$run.log"
      timeout 300 env FLASH_ATTN_SM90_WS_BWD=$flag "$bin" "${hdims[@]}" >"$out" 2>&1
      status=$?
      tflops=$(awk -F'|' '/^\| bwd /{printf " %6.1f", $10}' "$out")
      echo "$(basename "$bin") =$flag run $run:$tflops | checks $(grep -c 'OK$' "$out") OK," \
           "$(grep -c WRONG "$out") wrong, exit $status"
    done
  done
done

if [ "${SANITIZE:-0}" = 1 ]; then
  for bin in "$@"; do
    for d in "${hdims[@]}"; do
      for tool in synccheck memcheck; do
        timeout 600 env FLASH_ATTN_SM90_WS_BWD=1 FLASH_BENCH_REPS=1 compute-sanitizer --tool $tool "$bin" --one "$d" 1024 \
          >"$LOG/$(basename "$bin")_${tool}_d$d.log" 2>&1
        echo "$(basename "$bin") $tool d$d: exit $? -- $(grep -E 'ERROR SUMMARY' "$LOG/$(basename "$bin")_${tool}_d$d.log")"
      done
    done
  done
fi
