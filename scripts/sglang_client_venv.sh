#!/usr/bin/env bash
# A venv holding SGLang's own frontend client, for tests/test_sglang_real_client.py (never the project's venv: the
# sglang wheel pins torch and much else). Its frontend imports torch and a few small packages; the rest of its
# dependencies (CUDA kernels, ...) serve SGLang's server only, so the wheel goes in without them.
# Usage: scripts/sglang_client_venv.sh [DIR]   (default /tmp/sglvenv; the tests read $RADIXSERVE_SGLANG_PYTHON)
set -euo pipefail
dir="${1:-/tmp/sglvenv}"
python3 -m venv "$dir"
pip="$dir/bin/pip"
"$pip" install -q torch==2.13.0  # the CPU build first, so nothing pulls a CUDA one
"$pip" install -q --no-deps sglang==0.5.23
"$pip" install -q requests numpy tqdm orjson psutil pybase64 triton packaging pillow starlette msgspec pydantic \
    pyzmq IPython aiohttp
"$dir/bin/python" -c "import sglang; sglang.RuntimeEndpoint; print('sglang', sglang.__version__, 'frontend ready')"
