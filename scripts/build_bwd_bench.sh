#!/usr/bin/env bash
# Builds benchmarks/csrc/attention_bwd_bench.cu against the kernels of SRC_DIR (a copy of
# csrc/flash_attn/src holding a kernel variant), bf16 only, for sm_90a, with setup.py's nvcc flags
# (csrc/build_flags.py). Head dims 64 and 128; BENCH_HDIM256=1 adds 256 (four more units).
# No PyTorch needed: build variants here, carry the binaries to the GPU machine, time them there
# (scripts/gpu_harness_check.sh for one binary under every flag, scripts/gpu_harness_compare.sh for
# variants back to back).
#
#   scripts/build_bwd_bench.sh SRC_DIR OUT_BINARY [JOBS (default 2)]
set -euo pipefail
SRC=$(cd "${1:?SRC_DIR}" && pwd); OUT=${2:?OUT_BINARY}; HDIMS=64,128; [ "${BENCH_HDIM256:-0}" = 1 ] && HDIMS=64,128,256; JOBS=${3:-2}
REPO=$(cd "$(dirname "$0")/.." && pwd)
CUTLASS=$(python3 -c "import sys; sys.path.insert(0, '$REPO/csrc'); import build_flags as b; print(b.cutlass_include_dir())")
python3 - "$REPO" "$SRC/generated" "$HDIMS" <<'PY'
import importlib.util, sys
spec = importlib.util.spec_from_file_location("g", sys.argv[1] + "/csrc/flash_attn/generate_kernels.py")
g = importlib.util.module_from_spec(spec); spec.loader.exec_module(g)
g.write_instantiations(sys.argv[2], [int(d) for d in sys.argv[3].split(",")], ["bf16"])
PY
OBJ=$(mktemp -d)
# Objects are cached by the hash of their preprocessed source, so variants that change only the
# backward reuse the forward units.
CACHE=${BWD_BENCH_CACHE:-/tmp/bwd_bench_cache}; mkdir -p "$CACHE"
FLAGS="$(python3 -c "import sys; sys.path.insert(0, '$REPO/csrc'); import build_flags as b; \
print(' '.join(b.kernel_flags(['90'])))") -I$SRC -I$CUTLASS -Xptxas -v"
export FLAGS OBJ CACHE SRC
compile_one() {
  name=$(basename "$1" .cu)
  # The key leaves out line markers and the source directory, so a unit whose text is the same
  # in two variant trees is compiled once.
  key=$( { nvcc $FLAGS -E "$1" 2>/dev/null | grep -v '^#'; echo "${FLAGS//$SRC/}"; } | sha1sum | cut -c1-16)
  if [ ! -f "$CACHE/$key.o" ]; then
    nvcc $FLAGS -c "$1" -o "$CACHE/$key.tmp.o" >"$CACHE/$key.log" 2>&1 || { cat "$CACHE/$key.log"; return 255; }
    mv "$CACHE/$key.tmp.o" "$CACHE/$key.o"
  fi
  cp "$CACHE/$key.o" "$OBJ/$name.o"; cp "$CACHE/$key.log" "$OBJ/$name.log"
}
export -f compile_one
ls "$SRC"/generated/*.cu | grep -v _dropout | xargs -P "$JOBS" -I{} bash -c 'compile_one {}'
# The harness itself is not cached: its head-dim list is a define.
HARNESS_DEFINES=""; [ "${BENCH_HDIM256:-0}" = 1 ] && HARNESS_DEFINES=-DFLASH_BENCH_HDIM256
nvcc $FLAGS $HARNESS_DEFINES -c "$REPO"/benchmarks/csrc/attention_bwd_bench.cu -o "$OBJ/attention_bwd_bench.o" \
  >"$OBJ/attention_bwd_bench.log" 2>&1 || { cat "$OBJ/attention_bwd_bench.log"; exit 1; }
nvcc -gencode arch=compute_90a,code=sm_90a "$OBJ"/*.o -o "$OUT"
grep -h -A3 -E "Compiling entry function .*flash_bwd_(ws_)?kernel" "$OBJ"/flash_bwd_*.log | grep -E "Compiling|spill|registers" | sed 's/ptxas info    ://' || true
