"""SGLang's server arguments (`sgl.Runtime(model_path, tp_size=1, mem_fraction_static=0.8, ...)`) as Engine arguments.

Each argument SGLang programs commonly pass is in exactly one of three groups: mapped onto the Engine argument that
means the same; harmless here (it tunes a server process, a GPU memory split or a kernel choice radixserve does not
have, and cannot change a program's results), so it is ignored with a warning; or refused, because ignoring it would
change what the program computes (another tokenizer, chat template, quantization, adapter, seed). An unknown name is
a TypeError, as a misspelt keyword would be.
"""

from __future__ import annotations

import warnings
from typing import Any

from frontend_dsl.errors import NotSupportedError

# SGLang name -> (Engine name, value conversion)
MAPPED: dict[str, tuple[str, Any]] = {
    "disable_radix_cache": ("enable_radix_cache", lambda v: not v),
}

HARMLESS = {
    "host": "the in-process Runtime serves no HTTP",
    "port": "the in-process Runtime serves no HTTP",
    "api_key": "the in-process Runtime serves no HTTP",
    "log_level": "radixserve logs through `logging`",
    "log_level_http": "the in-process Runtime serves no HTTP",
    "log_requests": "radixserve logs through `logging`",
    "mem_fraction_static": "the KV pool is sized by max_total_tokens",
    "tp_size": "radixserve runs a model on one device",
    "dp_size": "radixserve runs a model on one device",
    "trust_remote_code": "radixserve loads its own model classes, never a checkpoint's code",
    "disable_cuda_graph": "radixserve does not capture CUDA graphs",
    "cuda_graph_max_bs": "no CUDA graphs",
    "enable_torch_compile": "radixserve does not torch.compile",
    "stream_interval": "chunks stream per token",
    "schedule_conservativeness": "radixserve's scheduler has no such knob",
    "max_prefill_tokens": "prefill is chunked by chunked_prefill_size",
    "enable_metrics": "metrics are always on",
    "enable_cache_report": "cached_tokens is always in meta_info",
    "show_time_cost": "no time-cost report",
    "watchdog_timeout": "no watchdog",
    "base_gpu_id": "pass device= (e.g. 'cuda:1') instead",
    "download_dir": "models are local folders or .gguf files",
    "sampling_backend": "one sampler",
    "grammar_backend": "no constrained decoding yet",
    "tokenizer_mode": "one tokenizer implementation",
}

REFUSED = {
    "tokenizer_path": "a different tokenizer changes the prompt tokens",
    "chat_template": "a different chat template changes the role text",
    "quantization": "radixserve's own formats are auto, none, int8 and int4 (CPU); another one would run another model",
    "kv_cache_dtype": "the KV cache has the model's dtype; another one changes results",
    "lora_paths": "radixserve has no LoRA adapters",
    "revision": "models are local folders",
    "load_format": "models load from safetensors or GGUF only",
    "is_embedding": "radixserve only generates",
    "random_seed": "radixserve has no server-wide seed; results would not be the seeded ones",
    "skip_tokenizer_init": "the DSL needs the tokenizer",
    "json_model_override_args": "configs are not overridden",
    "speculative_algorithm": "radixserve has no speculative decoding",
}


# Names SGLang and radixserve share with different value sets: only radixserve's values pass through.
_OWN_VALUES = {"quantization": ("auto", "none", "int8", "int4")}


def _engine_params() -> set[str]:
    from dataclasses import fields

    from radixserve.engine_config import EngineConfig

    return {f.name for f in fields(EngineConfig)} - {"model"}


def engine_args_from_server_args(server_args: dict[str, Any]) -> dict[str, Any]:
    """Engine keyword arguments for SGLang-style (or Engine) keyword arguments; warns and refuses as above."""
    own = _engine_params()
    out: dict[str, Any] = {}
    for name, value in server_args.items():
        if name in MAPPED:
            target, convert = MAPPED[name]
            out[target] = convert(value)
        elif name in own and not (name in REFUSED and value not in _OWN_VALUES.get(name, ())):
            out[name] = value
        elif name in HARMLESS:
            if name in ("tp_size", "dp_size") and value not in (None, 1):
                warnings.warn(f"Runtime({name}={value}) ignored: {HARMLESS[name]}", stacklevel=3)
            elif name not in ("tp_size", "dp_size"):
                warnings.warn(f"Runtime({name}=...) ignored: {HARMLESS[name]}", stacklevel=3)
        elif name in REFUSED:
            raise NotSupportedError(f"Runtime({name}=...) is not supported: {REFUSED[name]}")
        else:
            raise TypeError(
                f"Runtime got an unknown argument {name!r} (neither an SGLang server argument "
                f"radixserve knows nor an Engine argument: {', '.join(sorted(own))})"
            )
    return out
