#!/usr/bin/env bash
# On the GPU machine (the device tool's `run`, with carry [".whl"]): install the carried wheels, then every GPU
# check and benchmark in one process. Arguments go to run_all (e.g. --sections attention,graphs).
# Results: $OUT/results.md, $OUT/results.json, $OUT/log.txt (benchmarks/out/ when OUT is unset).
#
# FlashInfer compiles its kernels with nvcc on first use (minutes). With SAVE_AOT=1 the compiled modules come back
# as $OUT/flashinfer_aot.tgz.* (split under the 16 MiB per-file limit); put them in .whl/aot/ here and the next
# machine loads them as FlashInfer's AOT modules instead of compiling (same flashinfer version and GPU arch).
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
AOT=/tmp/site/flashinfer/data/aot
if compgen -G ".whl/aot/flashinfer_aot.tgz.*" >/dev/null; then
  mkdir -p "$AOT" && cat .whl/aot/flashinfer_aot.tgz.* | tar -xz -C "$AOT" && echo "AOT modules: $(ls "$AOT" | wc -l)"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader || true
# Stop short of the device's 10-minute limit so that the results and the compiled modules still come back.
timeout --signal=INT "${RUN_TIMEOUT:-540}" python3 -m benchmarks.gpu.run_all --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
if [ "${SAVE_AOT:-0}" = 1 ]; then
  # Modules compiled now join those restored above; together they are the next machine's AOT set.
  jit=$(python3 -c "from flashinfer.jit import env; print(env.FLASHINFER_JIT_DIR)")
  mkdir -p "$AOT" && (cd "$jit" 2>/dev/null && find . -name '*.so' -exec cp --parents {} "$AOT" \;)
  (cd "$AOT" && find . -name '*.so' | tar -czf - -T - | split -b 15m - "$OUT/flashinfer_aot.tgz.")
  ls -la "$OUT"/flashinfer_aot.tgz.* 2>/dev/null
fi
exit "$status"
