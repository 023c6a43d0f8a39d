#!/usr/bin/env bash
# Make .venv with everything radixserve, its tests and the default model need. Idempotent: a stamp of the
# dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.bootstrap-$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: 2.13.0 is the CPU build on this project's machines; unpinned pip would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev,model]"
rm -f .venv/.bootstrap-*
touch "$stamp"
