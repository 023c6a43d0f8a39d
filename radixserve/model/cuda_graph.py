"""CUDA graphs for decode steps: one graph per batch size of a ladder, a batch padded up to the next size.

A decode step launches hundreds of small kernels; replaying a captured graph launches them all at once, so the GPU
no longer waits on Python between kernels. Graphs are captured at fixed batch sizes (`graph_batch_sizes`); a
batch of B requests runs the graph of the smallest size >= B, the extra rows being sink requests (one token at
position 0 whose K/V go to slot 0 of page 0, the pool's padding sink). Larger batches, and any step that is not a
pure decode, run eagerly (`can_run` says which). Nothing here touches CUDA until a CudaGraphRunner is built.

The attention backend must provide `init_cuda_graph(batch_sizes, max_pages_per_request)` and
`plan_cuda_graph(batch)` (the flashinfer backend does): graph replays read fixed index buffers that
`plan_cuda_graph` refills before each replay.
"""

from __future__ import annotations

import bisect

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.forward_batch import ForwardBatch
from radixserve.model.llama import LlamaForCausalLM


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, every 16 up to 256, every 32 beyond, capped by and ending at max_batch_size.

    A padded batch wastes fewer rows than one step of the ladder: under 8 up to 64, 16 up to 256, 32 beyond
    (cheap in decode, where reading the weights dominates), and 20-odd graphs cover 256.
    """
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, 257, 16))
    top = sizes[-1]
    while top < max_batch_size:
        top += 32
        sizes.append(top)
    return sorted({s for s in sizes if s < max_batch_size} | {max_batch_size})


def padded_batch_size(batch_size: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= batch_size, or None when the batch is larger than every graph (run eagerly)."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def pad_decode_batch(batch: ForwardBatch, size: int) -> ForwardBatch:
    """Append `size - B` sink requests to a pure-decode batch; real rows, and `logits_indices`, keep their places."""
    n = size - batch.batch_size
    if n < 0:
        raise ValueError(f"cannot pad a batch of {batch.batch_size} down to {size}")
    if not batch.is_decode:
        raise ValueError("only pure-decode batches (one new token per request) run as CUDA graphs")
    dev, table = batch.input_ids.device, batch.page_table

    def cat(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.cat([t, torch.full((n,), fill, dtype=t.dtype, device=t.device)])

    return ForwardBatch(
        input_ids=cat(batch.input_ids.to(dev), 0),
        positions=cat(batch.positions.to(dev), 0),
        out_cache_loc=cat(batch.out_cache_loc.to(dev), 0),  # slot 0 of the sink page
        prefix_lens=cat(batch.prefix_lens, 0),
        extend_lens=cat(batch.extend_lens, 1),
        seq_lens=cat(batch.seq_lens, 1),
        qo_indptr=torch.arange(size + 1, dtype=torch.int32),
        page_table=torch.cat([table, torch.zeros((n, table.shape[1]), dtype=table.dtype, device=table.device)]),
        page_size=batch.page_size,
        logits_indices=batch.logits_indices,
    )


class CudaGraphRunner:
    """Captures `model` decode steps over `attn` at every ladder size up to `max_batch_size`; `forward` replays one.

    `max_context_len` bounds the tokens of any request in a replayed batch (it sizes the fixed page-index buffer).
    """

    def __init__(
        self, model: LlamaForCausalLM, attn: AttentionBackend, max_batch_size: int, max_context_len: int
    ) -> None:
        device = attn.pool.device
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"CUDA graphs need a CUDA device; the KV pool is on {device}")
        if not (hasattr(attn, "init_cuda_graph") and hasattr(attn, "plan_cuda_graph")):
            raise ValueError(
                f"attention backend {type(attn).__name__} cannot run in CUDA graphs "
                "(it has no init_cuda_graph/plan_cuda_graph)"
            )
        self.model, self.attn, self.device = model, attn, device
        self.page_size = attn.pool.page_size
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_context_len = max_context_len
        max_pages = -(-max_context_len // self.page_size)
        attn.init_cuda_graph(self.sizes, max_pages)
        with torch.inference_mode():
            self.input_ids = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
            self.positions = torch.zeros(self.sizes[-1], dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.memory_pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._capture(size)

    def _static_batch(self, size: int) -> ForwardBatch:
        """The batch the captured graph reads: the fixed input buffers. Only input_ids and positions are read by
        the model; the backend writes K/V at the slots of its own fixed buffer (filled by plan_cuda_graph)."""
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_cache_loc=self.positions[:size],
            prefix_lens=torch.zeros(size, dtype=torch.int32),
            extend_lens=torch.ones(size, dtype=torch.int32),
            seq_lens=torch.ones(size, dtype=torch.int32),
            qo_indptr=torch.arange(size + 1, dtype=torch.int32),
            page_table=torch.zeros((size, 1), dtype=torch.int32, device=self.device),
            page_size=self.page_size,
            logits_indices=torch.arange(size, device=self.device),
        )

    def _step(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.compute_logits(self.model(batch, self.attn))

    @torch.inference_mode()
    def _capture(self, size: int) -> None:
        empty = ForwardBatch.build([], [], [], self.page_size, [], self.device)
        self.attn.plan_cuda_graph(pad_decode_batch(empty, size))  # sink requests only
        batch = self._static_batch(size)
        # Warm up on a side stream first (as torch.cuda.graphs asks): lazy init and autotuning stay out of the graph.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self.logits[size] = self._step(batch)
        self.graphs[size] = graph

    def can_run(self, batch: ForwardBatch) -> bool:
        """True for a pure-decode batch no larger than the largest graph, every request within max_context_len."""
        return (
            batch.is_decode
            and 0 < batch.batch_size <= self.sizes[-1]
            and int(batch.seq_lens.max()) <= self.max_context_len
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits for `batch.logits_indices`, like ModelRunner.forward; the batch must pass `can_run`."""
        if not self.can_run(batch):
            raise ValueError("this batch cannot replay a CUDA graph; run it eagerly")
        size = padded_batch_size(batch.batch_size, self.sizes)
        assert size is not None
        padded = pad_decode_batch(batch, size)
        self.input_ids[:size].copy_(padded.input_ids, non_blocking=True)
        self.positions[:size].copy_(padded.positions, non_blocking=True)
        self.attn.plan_cuda_graph(padded)
        self.graphs[size].replay()
        # A copy: the next replay overwrites the graph's output buffer.
        return self.logits[size].index_select(0, batch.logits_indices.to(self.device))
