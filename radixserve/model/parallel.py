"""Tensor-parallel layers and the weight sharding behind them (Megatron-style, as vLLM and SGLang do).

Every rank holds a shard of each layer: q/k/v and gate/up are column-parallel (each rank computes its heads and its
slice of the MLP's inner width, no communication), o_proj and down_proj are row-parallel (each rank multiplies its
input slice and an all_reduce sums the partial outputs), the embedding is vocab-parallel (a rank looks up the ids in
its vocabulary rows, zeros the others, all_reduce) and so is the LM head (each rank scores its vocabulary rows and an
all_gather concatenates them). Norms, RoPE and everything between layers are replicated.

Heads: each rank takes num_heads / tp query heads. KV heads split the same way when they divide by tp; when tp is a
multiple of num_kv_heads instead, every rank holds the one KV head its query heads share (replicated, as vLLM does).
Any other split would give a rank query heads of several partially held KV groups: a ValueError names the counts.

The model is built from `local_config` (per-rank heads and MLP width), then `parallelize` swaps in the parallel
embedding, row-parallel projections and LM head; `shard_weights` slices each full checkpoint tensor as it streams by,
so `LlamaForCausalLM.load_weights` sees tensors of the shard's shape and needs no change.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from radixserve.config import ModelConfig
from radixserve.model.llama import Linear, LlamaForCausalLM


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `size` holds: its query heads, KV heads (from global KV head `kv_start`), MLP columns and
    vocabulary rows (`vocab_rows` each, the last rank's padded with zero rows past the real vocabulary)."""

    rank: int
    size: int
    num_heads: int
    num_kv_heads: int
    kv_start: int
    intermediate: int
    vocab_rows: int
    vocab_size: int

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows


def plan_shard(config: ModelConfig, size: int, rank: int = 0) -> Shard:
    """Rank `rank`'s shard of `config` over `size` ranks; ValueError naming the counts when the split cannot work."""
    heads, kv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"tensor parallel rank {rank} of {size} is not a valid rank")
    if heads % size:
        raise ValueError(f"tp={size} does not divide num_attention_heads={heads}: each rank needs whole query heads")
    if kv % size == 0:
        kv_local, kv_start = kv // size, rank * (kv // size)
    elif size % kv == 0:
        # tp > num_kv_heads: each group of size/kv ranks shares (replicates) one KV head, the one its queries use.
        kv_local, kv_start = 1, rank // (size // kv)
    else:
        raise ValueError(
            f"tp={size} cannot split num_key_value_heads={kv} (with num_attention_heads={heads}): "
            f"tp must divide the KV heads or be a multiple of them (to replicate them)"
        )
    if inter % size:
        raise ValueError(f"tp={size} does not divide intermediate_size={inter}")
    vocab_rows = -(-config.vocab_size // size)
    return Shard(rank, size, heads // size, kv_local, kv_start, inter // size, vocab_rows, config.vocab_size)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config one rank builds its layers from: its heads and MLP width (head_dim and hidden size stay)."""
    return replace(
        config, num_heads=shard.num_heads, num_kv_heads=shard.num_kv_heads, intermediate_size=shard.intermediate
    )


class RowParallelLinear(Linear):
    """A rank's columns of W (its slice of the input features); the partial products are summed over the group.

    The bias is loaded on rank 0 only (zeros elsewhere), so the sum adds it once."""

    group: dist.ProcessGroup | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        dist.all_reduce(y, group=self.group)
        return y


class VocabParallelEmbedding(nn.Embedding):
    """Rows vocab_start .. vocab_start + rows - 1 of the embedding; ids outside them read zeros, summed over ranks."""

    def __init__(self, shard: Shard, hidden: int, dtype: torch.dtype, group: dist.ProcessGroup | None) -> None:
        super().__init__(shard.vocab_rows, hidden, _weight=torch.empty(shard.vocab_rows, hidden, dtype=dtype))
        self.start, self.group = shard.vocab_start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(Linear):
    """A rank's vocabulary rows of the LM head; every rank gets the whole `[N, vocab]` logits by all_gather."""

    group: dist.ProcessGroup | None = None
    vocab_size: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def _row_parallel(old: Linear, group: dist.ProcessGroup | None) -> RowParallelLinear:
    out_features, in_features = old.weight.shape
    new = RowParallelLinear(in_features, out_features, old.bias is not None, old.weight.dtype)
    new.group = group
    return new


def parallelize(model: LlamaForCausalLM, shard: Shard, group: dist.ProcessGroup | None = None) -> None:
    """Swap in the vocab-parallel embedding and LM head and the row-parallel o_proj/down_proj of a model built from
    `local_config` (call under the model's device context, before `load_weights`)."""
    dtype = model.embed_tokens.weight.dtype
    model.embed_tokens = VocabParallelEmbedding(shard, model.config.hidden_size, dtype, group)
    for layer in model.layers:
        layer.self_attn.o_proj = _row_parallel(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj, group)
    if model.lm_head is not None:
        head = VocabParallelHead(model.config.hidden_size, shard.vocab_rows, False, dtype)
        head.group, head.vocab_size = group, shard.vocab_size
        model.lm_head = head


def tie_parallel_head(model: LlamaForCausalLM, shard: Shard, group: dist.ProcessGroup | None = None) -> None:
    """A tied model's LM head: the rank's embedding rows as a VocabParallelHead (call after `load_weights`)."""
    if model.lm_head is None:
        weight = model.embed_tokens.weight
        head = VocabParallelHead(weight.shape[1], weight.shape[0], False, weight.dtype)
        head.weight, head.group, head.vocab_size = weight, group, shard.vocab_size
        model.tied_head = head


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], config: ModelConfig, shard: Shard
) -> Iterator[tuple[str, torch.Tensor]]:
    """The rank's slice of each Hugging Face-named full tensor (see the module docstring for which dimension)."""
    d = config.head_dim
    q_rows = (shard.rank * shard.num_heads * d, shard.num_heads * d)
    kv_rows = (shard.kv_start * d, shard.num_kv_heads * d)
    mlp_rows = (shard.rank * shard.intermediate, shard.intermediate)
    for name, t in weights:
        module, _, kind = name.rpartition(".")
        part = module.rpartition(".")[2]
        if part == "q_proj":
            t = t.narrow(0, *q_rows)
        elif part in ("k_proj", "v_proj"):
            t = t.narrow(0, *kv_rows)
        elif part in ("gate_proj", "up_proj"):
            t = t.narrow(0, *mlp_rows)
        elif part == "o_proj" and kind == "weight":
            t = t.narrow(1, *q_rows)
        elif part == "o_proj":  # its bias is added once, after the sum over ranks
            t = t if shard.rank == 0 else torch.zeros_like(t)
        elif part == "down_proj":
            t = t.narrow(1, *mlp_rows)
        elif part in ("embed_tokens", "lm_head"):
            t = _vocab_rows(t, shard)
        yield name, t


def _vocab_rows(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    start = min(shard.vocab_start, t.shape[0])
    rows = t[start : start + shard.vocab_rows]
    if rows.shape[0] < shard.vocab_rows:  # the last shard of a vocabulary that tp does not divide
        rows = torch.cat([rows, rows.new_zeros(shard.vocab_rows - rows.shape[0], *rows.shape[1:])])
    return rows
