#!/usr/bin/env bash
# Here (with PyPI): download the wheels the GPU machine lacks into .whl/ (ignored by git), for its Python 3.12.
# flashinfer-python is pure Python (it JIT-compiles its kernels with the machine's nvcc); apache-tvm-ffi is its
# FFI layer; nvidia-ml-py (pynvml) is in the machine's image too, carried to pin the version flashinfer was seen with.
# The other Requires-Dist of flashinfer (cuda-tile, nccl4py, cudnn-frontend, cutlass-dsl) serve backends we do not
# use and are not imported by `import flashinfer`; the rest (torch, numpy, ninja, einops, ...) are in the image.
# gguf, msgspec and llguidance are the radixserve dependencies the engine imports that the image lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
WHEELS=(flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py==13.615.71 gguf==0.19.0
  msgspec==0.22.0 llguidance==1.9.1)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
# One version of each package: two would stop the install on the GPU machine.
dups=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
[ -z "$dups" ] || { echo "more than one wheel of: $dups (remove the stale ones from .whl/)"; exit 1; }
git check-ignore -q .whl/ || { echo ".whl/ must be ignored by git"; exit 1; }
du -ch .whl/*.whl
