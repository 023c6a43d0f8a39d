"""Model runner: the weights, the KV pool and the attention backend; one forward per scheduled step."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from radixserve.host_memory import available_ram
from radixserve.attention.base import AttentionBackend
from radixserve.cache.kv_format import resolve_kv_dtype
from radixserve.model.cpu_stack import build_stack
from radixserve.model.key_center import center_keys
from radixserve.model.llama import LlamaForCausalLM
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ModelConfig
from radixserve.distributed import PageTransfer
from radixserve.forward_batch import ForwardBatch
from radixserve.model.loader import load_model, read_config
from radixserve.model.null import NullModel
from radixserve.sampling.info import SamplingInfo
from radixserve.sampling.sampler import chosen_logprobs, sample_ids, token_logprobs
from radixserve.sampling.speculative import verify
from radixserve.step import ScheduledBatch, StepOutput
from radixserve.tp_pool import serve_transfer
from radixserve.transfer import device_tensor, to_device

if TYPE_CHECKING:
    from radixserve.distributed import TPGroup

# On a CPU a bigger pool only costs memory as pages fill (it is zeroed lazily, see KVPool): 64k tokens hold dozens
# of long conversations, and a CPU computes far fewer tokens than that per minute. GPUs size it from free memory alone.
CPU_MAX_AUTO_TOKENS = 1 << 16
log = logging.getLogger(__name__)


def default_attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """FlashInfer on CUDA (the fast path there; float16/bfloat16 only), our Triton kernels for float32 on CUDA,
    the portable torch reference elsewhere."""
    if device.type != "cuda":
        return "torch"
    if dtype == torch.float32:
        log.info("float32 on CUDA: attention runs on the triton backend (flashinfer supports float16/bfloat16)")
        return "triton"
    return "flashinfer"


def bind_device(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (CUDA keeps one per thread; kernels launched without
    an explicit device, Triton's and graph captures among them, go there). A no-op off CUDA."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def make_backend(name: str, pool: KVPool, config: ModelConfig, max_batch_size: int = 256) -> AttentionBackend:
    """Construct an attention backend by name; GPU-only backends are imported only when asked for.

    `max_batch_size` (requests per step) sizes the flashinfer backend's split-KV workspace."""
    if name == "torch":
        from radixserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, config.num_heads, config.head_dim)
    if name == "triton":
        from radixserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, config.num_heads, config.head_dim)
    if name == "flashinfer":
        if pool.device.type != "cuda":
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device")
        from radixserve.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(pool, config.num_heads, config.head_dim, max_batch_size=max_batch_size)
    raise ValueError(f"attention_backend must be one of torch, triton, flashinfer; got {name!r}")


def _available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return available_ram()


class ModelRunner:
    """Owns the model and its KV memory; `forward(batch)` returns float32 logits for `batch.logits_indices`."""

    def __init__(
        self,
        model_path: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        page_size: int,
        max_total_tokens: int | None,
        attention_backend: str,
        max_running_requests: int,
        context_length: int | None = None,
        cuda_graph: bool = True,
        mem_fraction: float = 0.3,
        quantization: str = "none",
        tp: TPGroup | None = None,
        null_model: bool = False,
        deterministic: bool = False,
        kv_cache_dtype: str = "auto",
        kv_cache_bytes: int | None = None,
    ) -> None:
        self.device = device
        self.tp = tp  # tensor parallel: this rank's shard of the model and of every KV head (radixserve/distributed.py)
        bind_device(device)
        # Packing deferred: it runs while the rest of the engine and the server start (same outputs, see packing.py).
        if null_model:  # benchmarks and tests: the whole host path, no layer (radixserve/model/null.py)
            self.config = read_config(Path(model_path))
            self.model = NullModel(self.config, dtype, device)
        else:
            self.config, self.model = load_model(model_path, dtype, device, quantization, tp, defer_packing=True)
        cfg = self.model.config  # with tp, this rank's heads: its KV pool holds those alone
        kv_format = resolve_kv_dtype(kv_cache_dtype, dtype)
        if kv_cache_bytes is not None:  # a budget for whole pages (every rank's heads), as the tiers count them
            full = self.config
            max_total_tokens = kv_cache_bytes // kv_format.bytes_per_token(
                full.num_layers, full.num_kv_heads, full.head_dim
            )
        if max_total_tokens is None:
            bytes_per_token = kv_format.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
            ranks_here = tp.size if tp is not None and device.type == "cpu" else 1  # CPU ranks share one memory
            max_total_tokens = int(_available_memory(device) * mem_fraction) // ranks_here // bytes_per_token
            if device.type == "cpu":
                max_total_tokens = min(max_total_tokens, CPU_MAX_AUTO_TOKENS)
        num_pages = max_total_tokens // page_size + 1  # + the sink page
        if tp is not None:  # page ids mean the same pages on every rank: all pools get the smallest size
            num_pages = tp.min_int(num_pages)
        if num_pages < 2:
            raise ValueError(f"max_total_tokens={max_total_tokens} is less than one page of {page_size} tokens")
        self.pool = KVPool(
            cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype, device, kv_format
        )
        self.attn = make_backend(attention_backend, self.pool, cfg, max_running_requests)
        if kv_format.name == "int8":  # keys stored centered (radixserve/model/key_center.py)
            center_keys(self.model, dtype)
        if deterministic:  # batch-invariant linears and attention (radixserve/model/deterministic.py)
            from radixserve.model.deterministic import make_deterministic

            make_deterministic(self.model, self.attn)
        if device.type == "cpu" and isinstance(self.model, LlamaForCausalLM):  # after the key centers are set
            self.model.cpu_stack = build_stack(self.model)
        # Token ids sampled by the latest step, by request slot: the next step's decode inputs may name them before
        # the CPU has seen them (overlapped scheduling). Steps execute in order, so a slot is written before read.
        self.future_ids = torch.zeros(max_running_requests, dtype=torch.int64, device=device)
        # Decode steps replay captured CUDA graphs where the backend supports them; everything else runs eagerly.
        self.graphs = None
        # Not with tensor parallelism yet: capturing its collectives in a graph is untested (no multi-GPU machine).
        if cuda_graph and tp is None and device.type == "cuda" and hasattr(self.attn, "init_cuda_graph"):
            from radixserve.model.cuda_graph import CudaGraphRunner

            self.graphs = CudaGraphRunner(
                self.model, self.attn, max_running_requests, context_length or cfg.max_position_embeddings
            )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.forward(batch)
        self.attn.plan(batch)
        hidden = self.model(batch, self.attn)
        return self.model.compute_logits(hidden[batch.logits_indices])

    @torch.inference_mode()
    def serve_steps(self) -> None:
        """Tensor-parallel ranks above 0: run the forward of each batch rank 0 sends, until it stops."""
        assert self.tp is not None and self.tp.rank > 0
        while (step := self.tp.recv()) is not None:
            if isinstance(step, PageTransfer):  # rank 0's tiers spill or load whole pages (radixserve/tp_pool.py)
                serve_transfer(self.pool, self.tp, step)
                continue
            if step.copy_src is not None and step.copy_dst is not None:
                self.pool.copy_slots(step.copy_src, step.copy_dst)
            self.forward(step.batch)

    @torch.inference_mode()
    def execute(self, step: ScheduledBatch) -> "PendingOutput":
        """Forward, sample and score one scheduled step; runs on the loop thread or on the overlap worker.

        Returns once the step's work is queued: on a GPU the sampled ids come back through an event
        (`PendingOutput.wait`), so the overlap worker can queue the next step while this one runs.
        """
        batch = step.forward.to(self.device)
        if step.copy_src is not None and step.copy_dst is not None:  # partial-page reuse, before any KV is written
            self.pool.copy_slots(to_device(step.copy_src, self.device), to_device(step.copy_dst, self.device))
        if step.has_placeholders:
            ids = batch.input_ids
            batch.input_ids = torch.where(ids < 0, self.future_ids[(-ids - 1).clamp(min=0)], ids)
        if step.grammar is not None:
            step.grammar.start()  # the constrained rows' masks are computed on a side thread during the forward
        if self.tp is not None:  # every rank runs this forward on its shard; rank 0 alone samples
            logits = self._forward_tp(step, batch)
        else:
            logits = self.forward(batch)
        prompt = []
        for pr, (targets, top_k, wanted) in zip((p for p in step.prompt_rows if p is not None), step.prompt_targets):
            first, count, _ = pr
            prompt.append(token_logprobs(logits[first : first + count], torch.tensor(targets), top_k, wanted))
        rows = [r for r in step.sample_rows if r is not None]
        if not rows:
            return PendingOutput(None, StepOutput([], None, None, prompt))
        out = StepOutput([], None, None, prompt)
        drafts = step.sample_drafts()
        if any(drafts):  # a verify step: how many tokens each request gets is known only here (it syncs)
            if step.grammar is not None:  # constrained requests never draft: each has one row, rows[k]
                step.grammar.apply(logits, [rows[k] for k in step.grammar.rows])
            self._verify(logits, rows, drafts, step.sample_infos, out)
            self.future_ids[device_tensor(step.sample_slots, self.device)] = device_tensor(out.next_ids, self.device)
            return PendingOutput(None, out)
        if rows != list(range(logits.shape[0])):  # else every row in order (a decode step): no copy of [B, vocab]
            logits = logits.index_select(0, device_tensor(rows, self.device))
        if step.grammar is not None:
            step.grammar.apply(logits)
        next_ids = self._sample(logits, step.sample_infos, out)
        self.future_ids[device_tensor(step.sample_slots, self.device)] = next_ids
        return PendingOutput(next_ids, out)

    def _sample(self, logits: torch.Tensor, infos: list[SamplingInfo], out: StepOutput) -> torch.Tensor:
        """One id per row (with logprobs into `out` when asked); a failing batch is sampled row by row."""
        try:
            next_ids, raw_logprobs = sample_ids(logits, infos)
            if raw_logprobs is not None:
                out.logprobs, out.top_logprobs = chosen_logprobs(next_ids, raw_logprobs, infos)
        except Exception:  # noqa: BLE001 - find the rows at fault; the rest of the batch keeps its tokens
            next_ids = self._sample_rows_alone(logits, infos, out)
        return next_ids

    def _verify(
        self, logits: torch.Tensor, rows: list[int], drafts: list[list[int]], infos: list[SamplingInfo], out: StepOutput
    ) -> None:
        """Sampled request k's tokens: plain sampling without a draft, `verify` of its 1 + k rows with one."""
        n = len(infos)
        ids, lps, tops = [0] * n, [0.0] * n, [[] for _ in range(n)]
        plain = [k for k, d in enumerate(drafts) if not d]
        if plain:
            sub = StepOutput([], None, None, [])
            got = self._sample(
                logits.index_select(0, device_tensor([rows[k] for k in plain], self.device)),
                [infos[k] for k in plain],
                sub,
            ).tolist()
            for j, k in enumerate(plain):
                ids[k] = got[j]
                if sub.logprobs is not None and sub.top_logprobs is not None:
                    lps[k], tops[k] = sub.logprobs[j], sub.top_logprobs[j]
                if j in sub.failed:
                    out.failed[k] = sub.failed[j]
        for k, draft in enumerate(drafts):
            if not draft:
                continue
            try:
                run = verify(logits[rows[k] : rows[k] + 1 + len(draft)], infos[k], draft)
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                out.failed[k] = repr(exc)
                continue
            out.runs[k] = run
            ids[k] = run.ids[-1]
        out.next_ids = ids
        if any(i.return_logprob or i.top_logprobs_num for i in infos):
            out.logprobs, out.top_logprobs = lps, tops

    def _forward_tp(self, step: ScheduledBatch, batch: ForwardBatch) -> torch.Tensor:
        """Broadcast the batch, then run rank 0's shard. A fault in between leaves the other ranks inside collectives
        that can no longer be matched: the group is marked broken and every later step fails at once (the engine
        loop stops after a few), rather than feeding the ranks mismatched collectives."""
        assert self.tp is not None
        if self.tp.broken is not None:
            raise RuntimeError(f"tensor-parallel group unusable after an earlier fault: {self.tp.broken!r}")
        try:
            copy = None if step.copy_src is None or step.copy_dst is None else (step.copy_src, step.copy_dst)
            self.tp.send_batch(step.forward, batch.input_ids if step.has_placeholders else None, copy)
            return self.forward(batch)
        except BaseException as exc:
            self.tp.broken = exc
            raise

    def _sample_rows_alone(self, logits: torch.Tensor, infos: list[SamplingInfo], out: StepOutput) -> torch.Tensor:
        """Sample each row by itself (every row's arithmetic is independent of the batch, so good rows get the ids
        they would have got); a row that raises is recorded in `out.failed` and given id 0."""
        ids, lps, tops = [], [], []
        for k, info in enumerate(infos):
            try:
                row_ids, raw = sample_ids(logits[k : k + 1], [info])
                lp, top = chosen_logprobs(row_ids, raw, [info]) if raw is not None else ([0.0], [[]])
                ids.append(row_ids)
            except Exception as exc:  # noqa: BLE001
                out.failed[k] = repr(exc)
                ids.append(torch.zeros(1, dtype=torch.long, device=logits.device))
                lp, top = [0.0], [[]]
            lps += lp
            tops += top
        if any(i.return_logprob or i.top_logprobs_num for i in infos):
            out.logprobs, out.top_logprobs = lps, tops
        return torch.cat(ids)


class PendingOutput:
    """A step's output whose sampled ids may still be on their way from the device; `wait()` returns them."""

    def __init__(self, next_ids: torch.Tensor | None, out: StepOutput) -> None:
        self.out = out
        self.next_ids = next_ids
        self.ready: torch.cuda.Event | None = None
        if next_ids is not None and next_ids.is_cuda:
            self.next_ids = next_ids.to("cpu", non_blocking=True)  # into pinned memory, in stream order
            self.ready = torch.cuda.Event()
            self.ready.record()

    def wait(self) -> StepOutput:
        if self.next_ids is not None:
            if self.ready is not None:
                self.ready.synchronize()
            self.out.next_ids = self.next_ids.tolist()
            self.next_ids = None
        return self.out
