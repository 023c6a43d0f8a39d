"""An agent suite of our own (issue 35): one realistic program per agent library (the openai SDK, openai-agents,
langchain-openai, langgraph, pydantic-ai, instructor), 40 scenarios in all, run against any OpenAI-compatible server.

The libraries are not the project's dependencies: the scenarios run in a separate interpreter
(scripts/agent_suite_venv.sh makes one), one process per scenario (worker.py); the runner (`python -m
benchmarks.agent_suite`) runs in the project's and prints a table. Nothing here imports radixserve or the libraries
at package import, so both interpreters can import the package."""
