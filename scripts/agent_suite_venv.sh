#!/usr/bin/env bash
# A venv holding the agent libraries of benchmarks/agent_suite (issue 35): never the project's venv, so the product
# does not depend on them. Versions are pinned so the suite's table can be rerun on the same code.
# Usage: scripts/agent_suite_venv.sh [DIR]   (default /tmp/agentsuitevenv; the suite's --python and the tests'
# $RADIXSERVE_AGENT_SUITE_PYTHON take DIR/bin/python)
set -euo pipefail
dir="${1:-/tmp/agentsuitevenv}"
python3 -m venv "$dir"
pip="$dir/bin/pip"
"$pip" install -q \
    openai==3.57.0 \
    openai-agents==0.24.0 \
    langchain-openai==1.7.4 \
    langgraph==1.2.24 \
    "pydantic-ai-slim[openai]==2.68.0"
# instructor 1.17 pins jiter<0.15 while every openai 3.x needs jiter>=0.16, so pip refuses the pair: instructor goes
# in without its pins (it calls jiter only to parse partial JSON, an API that 0.16 keeps), then its other needs.
"$pip" install -q --no-deps instructor==1.17.0
"$pip" install -q "docstring-parser<1.0" "jinja2<4" "tenacity<10" "typer<1" "rich<15" "aiohttp<4" "requests<3"
# None of these may pull torch: a torch here would mean a library grew a heavy dependency the suite does not need.
if "$dir/bin/python" -c "import torch" 2>/dev/null; then echo "torch was pulled in: pin torch==2.13.0 first" >&2; exit 1; fi
"$dir/bin/python" -c "import openai, agents, langchain_openai, langgraph, pydantic_ai, instructor; print('agent suite venv ready')"
