"""The model publisher's recommended sampling settings, applied to requests that leave them unset (as vLLM applies
`generation_config.json` and Ollama its Modelfile): read from the model folder's generation_config.json, or, for a
GGUF (whose metadata carries none), from a small table of the models we ship or know."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from radixserve.sampling_params import SamplingParams

# generation_config.json keys that are sampling settings, under our names.
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}
# Converted GGUF folders by name (radixserve/model/resolve.py names them after the file): the publisher's
# generation_config.json of the original checkpoint (Qwen2.5 instruct family; 1.1 repetition penalty at 0.5B).
PUBLISHER_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2.5-coder-0.5b-instruct": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1},
}


def load_sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """Sampling settings the model's publisher recommends ({} when none are known); validated like a request's."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    found = {ours: config[theirs] for theirs, ours in KEYS.items() if theirs in config}
    if config.get("do_sample") is False:  # the publisher asks for greedy decoding
        found = {"temperature": 0.0}
    if not found:
        found = dict(PUBLISHER_DEFAULTS.get(Path(model_dir).name.lower(), {}))
    if found:
        SamplingParams.from_dict(found)  # a malformed config fails at start-up, not in every request
    return found
