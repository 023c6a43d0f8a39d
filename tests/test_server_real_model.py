"""A 4-turn chat over HTTP with the real default model: each turn's cached prompt tokens cover >= 95% of the previous
turn's prompt and answer (the answer comes back as text, as any OpenAI client sends it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from radixserve.server.app import build_app
from radixserve.server.background import BackgroundServer
from real_model import real_engine, real_model_dir  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def client(real_engine: Any) -> Iterator[openai.OpenAI]:  # noqa: F811
    with BackgroundServer(build_app(real_engine)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_four_turn_chat_over_http_reuses_the_cache(client: openai.OpenAI, real_engine: Any) -> None:  # noqa: F811
    code = (REPO / "radixserve" / "server" / "chat_prompt.py").read_text()[:1500]
    questions = [
        f"Here is a Python module:\n```python\n{code}\n```\nWhat does `remember` store?",
        "Why are the generated ids kept?",
        "What happens when a template trims content?",
        "Summarize the module in one sentence.",
    ]
    model = real_engine.model_info()["model_name"]
    messages: list[dict[str, str]] = []
    previous = 0  # tokens of the previous turn's prompt and answer
    for turn, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
        if turn > 0:
            assert r.usage.prompt_tokens_details.cached_tokens >= 0.95 * previous, (turn, r.usage, previous)
        previous = r.usage.prompt_tokens + r.usage.completion_tokens
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
