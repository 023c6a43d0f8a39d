"""The scenario registry and the tools every library program gives its agents. A scenario is a function of the
server's OpenAI base URL (`http://host:port/v1`) that runs a library as its docs show and returns when the work
completed (the tool was called with valid arguments, its result went back, an answer came), or raises: a
ModelFailure from its own checks, or whatever the library raised. Runs in the libraries' interpreter."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.agent_suite.outcome import expect

Scenario = Callable[[str], None]
REGISTRY: dict[str, dict[str, Scenario]] = {}
MODEL = "default"  # any name serves: radixserve and llama-server each serve their one model
MAX_TOKENS = 256  # a bound on every turn, so a looping model fails in seconds, not minutes
MAX_ROUNDS = 3  # tool results a hand-written loop sends back before it gives up on an answer
SYSTEM = "You are a helpful assistant. Use the tools when they help; answer briefly."


def scenario(library: str) -> Callable[[Scenario], Scenario]:
    """Register the decorated function as `library`'s scenario of the same name."""

    def register(fn: Scenario) -> Scenario:
        REGISTRY.setdefault(library, {})[fn.__name__] = fn
        return fn

    return register


@dataclass
class ToolLog:
    """The calls the tools received, so a scenario can check that they came, with valid arguments."""

    calls: list[tuple[str, dict]] = field(default_factory=list)

    def get_weather(self, city: str, **extra: object) -> str:
        """Get the current weather in a city."""
        expect(not extra, f"get_weather called with undeclared arguments {extra}")
        expect(isinstance(city, str) and city.strip(), f"get_weather called with city={city!r}")
        self.calls.append(("get_weather", {"city": city}))
        return f"It is sunny and 22 degrees Celsius in {city}."

    def add(self, a: int, b: int, **extra: object) -> int:
        """Add two integers."""
        expect(not extra, f"add called with undeclared arguments {extra}")
        expect(isinstance(a, int) and isinstance(b, int), f"add called with a={a!r}, b={b!r}")
        self.calls.append(("add", {"a": a, "b": b}))
        return a + b

    def called(self, name: str) -> list[dict]:
        return [args for n, args in self.calls if n == name]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name, e.g. Paris"}},
            "required": ["city"],
        },
    },
}
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
# A long, fixed preamble so a second turn has a prefix worth caching (a multi-turn scenario checks it was).
LONG_SYSTEM = (
    SYSTEM
    + " "
    + " ".join(
        f"Rule {i}: keep answers short, name the city you speak of, and never invent weather you were not told."
        for i in range(1, 25)
    )
)


def answered(text: object, *needles: str) -> str:
    """The final answer's text, checked to be there and (case-insensitively) to mention each needle."""
    expect(isinstance(text, str) and text.strip(), f"no answer text (got {text!r})")
    assert isinstance(text, str)
    for n in needles:
        expect(n.lower() in text.lower(), f"answer does not mention {n!r}: {text[:120]!r}")
    return text
