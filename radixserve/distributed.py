"""Tensor-parallel process groups on torch.distributed: start the ranks, and send each step's batch from rank 0.

Rank 0 runs the scheduler, the radix tree and the sampler; ranks 1 .. N-1 only run the model forward on their shard
(radixserve/model/parallel.py) and own their slice of the KV pool. Page ids are the same on every rank, so the tree
on rank 0 stands for all of them: what the other ranks need per step is the ForwardBatch and the step's pool
copies (partial-page reuse copies a cached page's rows into a new page: every rank copies its own shard of them).

Start-up, either way torchrun's conventions (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT):
- under torchrun (those variables set), every process joins with `env://`; a rank above 0 becomes a worker;
- otherwise rank 0 spawns N-1 `python -m radixserve.tp_worker` processes on this machine with those variables set
  (a subprocess, not multiprocessing's spawn: a caller's script without a `__main__` guard is never re-imported).

Transport: NCCL on CUDA, gloo on CPU. Each step is two gloo broadcasts on a CPU group (an 8-int header, then every
int tensor of the batch and the copy slots in one buffer), plus, when the batch names ids still being sampled (overlap scheduling), the
resolved ids on the device group. The CPU group waits without a deadline: an idle server sends nothing for hours,
and a rank whose peer died still learns it at once, from the closed connection. The default group (the model's
collectives, and the start-up rendezvous) gives up after START_TIMEOUT.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from radixserve.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

_STOP, _STEP, _GATHER, _SCATTER = 0, 1, 2, 3
_HEADER = 8  # kind, tokens, requests, page-table width, logits rows, page size, has resolved ids, copied slots
# (a page transfer's header: kind, number of pages, then zeros)
IDLE_TIMEOUT = timedelta(days=365)
START_TIMEOUT = timedelta(minutes=10)
WORKER_EXIT_S = 30.0


def torchrun_env() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when torchrun (or a launcher with its conventions) started this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def rank_device(base: torch.device, local_rank: int) -> torch.device:
    """The device of the rank with this local rank: the CPU, or the local_rank-th GPU after `base`'s."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + local_rank)


@dataclass
class WorkerStep:
    """What a rank above 0 runs for one step: copy the pool's rows `copy_src` to `copy_dst` (flat slots, on its
    device; None when the step copies nothing), then the forward of `batch`."""

    batch: ForwardBatch
    copy_src: torch.Tensor | None
    copy_dst: torch.Tensor | None


@dataclass
class PageTransfer:
    """A rank above 0's part in moving whole KV pages between rank 0's tiers and every rank's pool (radixserve/
    tp_pool.py): `gather` sends this rank's shard of pool pages `pages` to rank 0 (`send_shard`); otherwise this
    rank receives its shard of them (`recv_shard`) and writes it into those pages."""

    gather: bool
    pages: torch.Tensor  # int64, on the CPU


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group, and (on rank 0) the workers it spawned."""

    rank: int
    size: int
    device: torch.device
    control: dist.ProcessGroup | None = None  # gloo, no deadline: step headers, batch metadata, start-up agreement
    group: dist.ProcessGroup | None = None  # the model's collectives (None: the default group)
    procs: list[subprocess.Popen] = field(default_factory=list)
    saved_threads: int | None = None
    closed: bool = False
    broken: BaseException | None = None  # a fault mid-step: the ranks' collectives can no longer be matched
    # Rank 0 sends from two threads with overlap on (steps from the worker, tier page transfers from the loop): each
    # message (header and body) goes out whole, so the workers read them in one order.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send_batch(
        self,
        batch: ForwardBatch,
        resolved_ids: torch.Tensor | None = None,
        copy: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Rank 0: broadcast one step's batch (built on the CPU); `resolved_ids` replace placeholder input ids;
        `copy` (src, dst flat slots) are the pool rows every rank copies before the forward."""
        t, b, n = batch.num_tokens, batch.batch_size, int(batch.logits_indices.numel())
        copied = 0 if copy is None else int(copy[0].numel())
        header = torch.tensor(
            [_STEP, t, b, batch.page_table.shape[1], n, batch.page_size, int(resolved_ids is not None), copied]
        )
        with self.lock:
            self._send_step(header, batch, resolved_ids, copy)

    def _send_step(
        self,
        header: torch.Tensor,
        batch: ForwardBatch,
        resolved_ids: torch.Tensor | None,
        copy: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        dist.broadcast(header, 0, group=self.control)
        parts = [
            batch.input_ids,
            batch.positions,
            batch.out_cache_loc,
            batch.logits_indices,
            batch.prefix_lens,
            batch.extend_lens,
            batch.seq_lens,
            batch.qo_indptr,
            batch.page_table.flatten(),
            *(copy or ()),
        ]
        dist.broadcast(torch.cat([p.cpu().long() for p in parts]), 0, group=self.control)
        if resolved_ids is not None:
            dist.broadcast(resolved_ids, 0, group=self.group)

    def recv(self) -> WorkerStep | PageTransfer | None:
        """Ranks above 0: the next step on this rank's device or page transfer, or None when rank 0 stops."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        kind, t, b, pages, n, page_size, resolved, copied = header.tolist()
        if kind == _STOP:
            return None
        if kind in (_GATHER, _SCATTER):
            ids = torch.empty(t, dtype=torch.int64)
            dist.broadcast(ids, 0, group=self.control)
            return PageTransfer(kind == _GATHER, ids)
        sizes = [t, t, t, n, b, b, b, b + 1, b * pages, copied, copied]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.control)
        ids, pos, loc, rows, prefix, extend, seq, indptr, table, src, dst = payload.split(sizes)
        batch = ForwardBatch(
            ids,
            pos,
            loc,
            prefix.int(),
            extend.int(),
            seq.int(),
            indptr.int(),
            table.int().reshape(b, pages),
            page_size,
            rows,
        ).to(self.device)
        if resolved:
            batch.input_ids = torch.empty(t, dtype=torch.int64, device=self.device)
            dist.broadcast(batch.input_ids, 0, group=self.group)
        if not copied:
            return WorkerStep(batch, None, None)
        return WorkerStep(batch, src.to(self.device), dst.to(self.device))

    # ---- whole pages for the tiers (rank 0 sends the header and page ids, then the shards move) ----------------
    def gather_pages(self, pages: torch.Tensor, local: torch.Tensor) -> list[torch.Tensor]:
        """Rank 0: every rank's shard of pool pages `pages` (int64, CPU), rank 0's own being `local` (CPU)."""
        with self.lock:
            self._send_transfer(_GATHER, pages)
            shards = [torch.empty_like(local) for _ in range(self.size)]
            dist.gather(_raw(local), [_raw(t) for t in shards], dst=0, group=self.control)
        return shards

    def scatter_pages(self, pages: torch.Tensor, shards: list[torch.Tensor]) -> None:
        """Rank 0: send rank r its shard `shards[r]` (CPU, contiguous) of pool pages `pages`; rank 0 keeps its own."""
        with self.lock:
            self._send_transfer(_SCATTER, pages)
            mine = torch.empty_like(shards[0])
            dist.scatter(_raw(mine), [_raw(t) for t in shards], src=0, group=self.control)

    def send_shard(self, local: torch.Tensor) -> None:
        """Ranks above 0, after a gather PageTransfer: this rank's shard (CPU, contiguous) to rank 0."""
        dist.gather(_raw(local), None, dst=0, group=self.control)

    def recv_shard(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Ranks above 0, after a scatter PageTransfer: this rank's shard (CPU)."""
        out = torch.empty(shape, dtype=dtype)
        dist.scatter(_raw(out), None, src=0, group=self.control)
        return out

    def _send_transfer(self, kind: int, pages: torch.Tensor) -> None:
        dist.broadcast(torch.tensor([kind, pages.numel()] + [0] * (_HEADER - 2)), 0, group=self.control)
        dist.broadcast(pages.long().contiguous(), 0, group=self.control)

    def min_int(self, value: int) -> int:
        """The smallest `value` over all ranks (every rank must call it at the same point)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def send_stop(self) -> None:
        """Rank 0: end the workers' current model (their `recv` returns None)."""
        with self.lock:
            dist.broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1)), 0, group=self.control)

    def close(self, kill: bool = False) -> None:
        """Rank 0: tell the workers to stop, wait for them, leave the group (idempotent). `kill`: do not wait."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.rank == 0 and not kill and self.broken is None:
                self.send_stop()
        except Exception as exc:  # noqa: BLE001 - a worker already gone: nothing to tell, the rest still runs
            log.warning("could not tell the tensor-parallel workers to stop: %r", exc)
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=0 if kill or self.broken is not None else WORKER_EXIT_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            if dist.is_initialized():
                dist.destroy_process_group()
            if self.saved_threads is not None:
                torch.set_num_threads(self.saved_threads)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as uint8 (gloo moves any dtype that way, bfloat16 included)."""
    return t.view(-1).view(torch.uint8)


def join(rank: int, size: int, local_rank: int, base: torch.device, init_method: str = "env://") -> TPGroup:
    """Join the group as `rank` of `size` (NCCL for CUDA, gloo otherwise) and make the CPU control group."""
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group already exists in this process: one TP engine per process")
    device = rank_device(base, local_rank)
    # The default group (the model's collectives, and the rendezvous: a rank that never shows up is an error after
    # START_TIMEOUT, not a hang) has a deadline; the control group, where an idle worker waits for work, has none.
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl", init_method=init_method, rank=rank, world_size=size, device_id=device, timeout=START_TIMEOUT
        )
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=START_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, size, device, control=control)


def start(size: int, base: torch.device, worker_args: list[str]) -> TPGroup | None:
    """Set up tensor parallelism over `size` ranks; None for size 1.

    Under torchrun this process joins as its RANK (above 0, the caller turns into a worker); otherwise it is rank 0
    and spawns `python -m radixserve.tp_worker *worker_args` for ranks 1 .. size-1. On a CPU the cores are split:
    each rank gets torch's thread count / size threads (restored at `close`)."""
    if size == 1:
        return None
    env = torchrun_env()
    if env is not None:
        rank, world, local_rank = env
        if world != size:
            raise ValueError(f"tp={size} but torchrun started WORLD_SIZE={world} processes: they must match")
        return join(rank, size, local_rank, base)
    if base.type == "cuda" and torch.cuda.device_count() < (base.index or 0) + size:
        raise ValueError(f"tp={size} needs {size} GPUs from {base}, but {torch.cuda.device_count()} are visible")
    saved = torch.get_num_threads()
    threads = max(1, saved // size)
    port = _free_port()
    procs = [_spawn(rank, size, port, threads, worker_args) for rank in range(1, size)]
    try:
        tp = join(0, size, 0, base, init_method=f"tcp://127.0.0.1:{port}")
    except BaseException:
        for p in procs:
            p.kill()
        raise
    tp.procs = procs
    if base.type == "cpu":
        tp.saved_threads = saved
        torch.set_num_threads(threads)
    return tp


def _spawn(rank: int, size: int, port: int, threads: int, worker_args: list[str]) -> subprocess.Popen:
    root = str(Path(__file__).resolve().parents[1])  # the radixserve this process runs, first on the worker's path
    env = {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return subprocess.Popen([sys.executable, "-m", "radixserve.tp_worker", *worker_args], env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
