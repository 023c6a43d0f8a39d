"""A model that costs nothing: fixed logits of the real model's shape at once (benchmarks and tests only).

With it (`Engine(null_model=True)`, `--null-model`) every step runs the engine's whole host path (scheduling, batch
and attention metadata, sampling, the output stage, detokenizing, streaming, metrics) but no layer, so the loop's
own cost per step can be measured on a CPU (benchmarks/loop_overhead.py). Nothing is written to the KV pool, and
the answers are meaningless: the same fixed distribution at every position.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.attention.base import AttentionBackend
from radixserve.config import ModelConfig
from radixserve.forward_batch import ForwardBatch

NULL_TOP_TOKEN = 42  # the greedy token: an ordinary id (not a special, not EOS) in every vocabulary we serve


class NullModel(nn.Module):
    """`forward` and `compute_logits` as LlamaForCausalLM's, returning views of buffers made once."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_rows: int = 1024) -> None:
        super().__init__()
        self.config = config
        self.hidden = torch.zeros(max_rows, 1, dtype=dtype, device=device)
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(config.vocab_size, generator=gen)  # a spread distribution: sampling does real work
        logits[NULL_TOP_TOKEN] = logits.max() + 2.0
        self.logits = logits.to(device)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        if batch.num_tokens > self.hidden.shape[0]:
            self.hidden = self.hidden.new_zeros(batch.num_tokens, 1)
        return self.hidden[: batch.num_tokens]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits `[rows, vocab]`, a fresh tensor as the LM head's is (grammars and penalties write into it).
        Its size goes with the vocabulary: a small one keeps tensor work (device work on a GPU) out of the way."""
        return self.logits.expand(hidden.shape[0], -1).clone()
