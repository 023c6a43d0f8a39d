"""The request-level fields of SGLang's `GenerateReqInput` that /generate declares beyond the ones it implements
(radixserve/server/protocol.py: GenerateFields): those that never change the output are accepted and ignored; the
others are refused with a 400 that names the field and says why, whenever they carry a value (None, false, 0 and
empty values are how SGLang's own clients leave them unset, so those pass). The sampling fields' counterpart is
radixserve/sampling_params.py (REFUSED)."""

from __future__ import annotations

from typing import Any

from radixserve.server.errors import bad_request

_MULTIMODAL = "the served models are text-only: no image, video or audio input"
_DISAGG = "prefill/decode disaggregation is not built"
_INTERNAL = "an internal field of SGLang's server, not for clients"

IGNORED = {
    "session_id": "a label shared by a session's requests; it does not change the prompt",
    "log_metrics": "metrics are always counted",
    "no_logs": "request contents are never logged",
    "custom_labels": "metric labels are the server's",
    "conversation_id": "a tracking label",
    "routing_key": "one engine: nothing to route",
    "received_time": "the server times requests itself",
    "external_trace_header": "traces follow the traceparent header (--otlp-endpoint)",
    "background": "for SGLang's Responses API",
}

REFUSED = {
    "input_embeds": "prompts are text or token ids; embeddings as input are not built",
    "image_data": _MULTIMODAL,
    "video_data": _MULTIMODAL,
    "audio_data": _MULTIMODAL,
    "mm_hashes": _MULTIMODAL,
    "mm_content_hashes": _MULTIMODAL,
    "use_audio_in_video": _MULTIMODAL,
    "video_config": _MULTIMODAL,
    "modalities": _MULTIMODAL,
    "max_dynamic_patch": _MULTIMODAL,
    "min_dynamic_patch": _MULTIMODAL,
    "image_max_dynamic_patch": _MULTIMODAL,
    "video_max_dynamic_patch": _MULTIMODAL,
    "images_config": _MULTIMODAL,
    "mm_processor_kwargs": _MULTIMODAL,
    "need_wait_for_mm_inputs": _MULTIMODAL,
    "num_items_assigned": _MULTIMODAL,
    "encoder_urls": _MULTIMODAL,
    "session_params": "sessions (continual prompting by session id) are not built; the radix cache reuses a "
    "resent prefix instead",
    "lora_path": "LoRA adapters are not built",
    "lora_id": "LoRA adapters are not built",
    "custom_logit_processor": "custom logit processors are not built (they are pickled code the server would run)",
    "positional_embed_overrides": "embedding overrides are not built",
    "return_hidden_states": "hidden states are not returned",
    "return_routed_experts": "the served models have no experts",
    "routed_experts_start_len": "the served models have no experts",
    "return_indexer_topk": "the served models have no sparse-attention indexer",
    "return_sampling_mask": "sampling masks are not returned",
    "sampling_logprobs_mode": "sampling masks are not returned",
    "return_flat_raw_top_logprobs": "top logprobs come as [logprob, id] lists only",
    "return_flat_raw_output_top_logprobs": "top logprobs come as [logprob, id] lists only",
    "return_flat_raw_top_logprobs_b64": "top logprobs come as [logprob, id] lists only",
    "return_entropy": "entropies are not returned",
    "return_prompt_token_ids": "prompt token ids are not returned (POST /tokenize gives them)",
    "require_reasoning": "reasoning controls are not built",
    "max_thinking_tokens": "reasoning controls are not built",
    "multi_item_delimiter_indices": "multi-item scoring is not built",
    "token_indices_to_pool": "pooling readout is not built",
    "kv_hints": "HiCache storage hints are not built (the tiers are radixserve's own)",
    "watermark": "output watermarking is not built",
    "bootstrap_host": _DISAGG,
    "bootstrap_port": _DISAGG,
    "bootstrap_room": _DISAGG,
    "bootstrap_pair_key": _DISAGG,
    "decode_tp_size": _DISAGG,
    "disagg_prefill_dp_rank": _DISAGG,
    "routed_dp_rank": "one engine per server: the only data-parallel rank is 0 (--dp routes by itself)",
    "data_parallel_rank": "one engine per server: the only data-parallel rank is 0 (--dp routes by itself)",
    "return_bytes": _INTERNAL,
    "http_worker_ipc": _INTERNAL,
}

DECLARED = (*IGNORED, *REFUSED)


def refuse_unbuilt(body: Any) -> None:
    """400 naming the first refused field that carries a value."""
    for name, why in REFUSED.items():
        if getattr(body, name):
            raise bad_request(f"{name}: {why}", param=name, code="unsupported_field")
