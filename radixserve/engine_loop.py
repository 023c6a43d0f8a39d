"""The engine's loop: one thread that alone touches scheduler state. It takes requests, aborts, calls and ends (a
stop string the output stage found) from an inbox, schedules a step, runs it (with overlap: launches it on a worker
thread and processes the previous one meanwhile), hands what each step did to the output stage (`publish`: it
detokenizes and answers callers on its own thread), and keeps a failure to the requests it belongs to
(Scheduler.fail_batches); a fault that repeats in every step stops it, and every waiting caller is told."""

from __future__ import annotations

from radixserve.log_bounds import bounded_logger

import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from radixserve.errors import EngineDeadError
from radixserve.model.runner import ModelRunner, PendingOutput, bind_device
from radixserve.request import ReqUpdate
from radixserve.scheduler.scheduler import Scheduler
from radixserve.step import ScheduledBatch
from radixserve.timeline import Tracker

log = bounded_logger("radixserve.engine")

IDLE_WAIT_S = 0.05
# A step that fails this many times in a row is no one request's fault: the engine stops (health 503; the server
# exits non-zero so that a supervisor restarts it) rather than failing every request that arrives.
MAX_STEP_FAILURES = 3
HEARTBEAT_LIMIT_S = 120.0  # a CPU prefill step can take seconds; only a loop silent this long counts as stuck


class EngineLoop:
    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        device: torch.device,
        overlap: bool,
        inbox: queue.Queue[tuple[Any, ...]],
        publish: Callable[[list[ReqUpdate]], None],
        tracker: Tracker | None = None,
        idle: Callable[[], None] | None = None,
    ) -> None:
        self.scheduler, self.runner, self.device = scheduler, runner, device
        self.publish = publish  # the output stage's intake (radixserve/output_stage.py)
        self.tracker = tracker or Tracker()
        self.idle = idle  # maintenance run between steps while there is no work (the disk tier's checkpoint)
        self.worker = (
            ThreadPoolExecutor(1, thread_name_prefix="radixserve-step", initializer=bind_device, initargs=(device,))
            if overlap
            else None
        )
        self.inbox = inbox
        self.live: list[tuple[ScheduledBatch, Future[PendingOutput] | None]] = []  # launched, not yet processed
        self.running_snapshot = 0  # requests running after the last step (read by other threads)
        self.error: BaseException | None = None
        self.heartbeat = time.monotonic()
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="radixserve-loop", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop the loop and wait for it; requests still queued or running end with finish_reason abort."""
        self._stopping.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join()

    def is_alive(self) -> bool:
        return self.thread.is_alive() and self.error is None and time.monotonic() - self.heartbeat < HEARTBEAT_LIMIT_S

    def run(self) -> None:
        sched = self.scheduler
        failures = 0
        try:
            bind_device(self.device)
            while not self._stopping.is_set():
                try:
                    self._step()
                    failures = 0
                    if self.idle is not None and not sched.has_work():
                        self.idle()
                except Exception as exc:  # noqa: BLE001 - isolated below; a fault that repeats stops the engine
                    failures += 1
                    log.error("engine step failed (%d in a row): %r", failures, exc, exc_info=exc)
                    if failures >= MAX_STEP_FAILURES:
                        raise
                finally:
                    self._publish()
                self.running_snapshot = len(sched.running)
                self.heartbeat = time.monotonic()
            while self.live:
                self._process_oldest()
            self.drain_inbox(block=False)
            for req in list(sched.waiting) + list(sched.running):
                sched.abort(req.rid)
            self._publish()
        except BaseException as exc:  # noqa: BLE001 - the loop must report any death to every waiting caller
            self.error = exc
            self.fail_all(EngineDeadError(f"engine loop died: {exc!r}"))
            raise
        finally:
            if self.worker is not None:
                self.worker.shutdown(wait=True)

    def _step(self) -> None:
        """Schedule one step and run it; with overlap, launch it and process the previous one meanwhile."""
        sched = self.scheduler
        self.drain_inbox(block=not self.live and not sched.has_work())
        self._publish()  # aborts' final outputs
        if self.live and self.live[-1][0].grammar is not None:
            # A grammar's next mask, and the tokens it forces (jump-forward), follow from the token in flight.
            self._process_oldest()
        running, retractions = list(sched.running), sched.stats.retractions
        batch = sched.schedule(can_retract=not self.live)
        if sched.stats.retractions != retractions:
            self._note_retracted(running)
        if batch is not None:
            self.tracker.scheduled(batch, sched.cache)
        if self.live and (batch is None or batch.needs_sync):
            self._process_oldest()
        if batch is None:
            return
        if self.worker is None:
            self.live.append((batch, None))
        else:
            self.live.append((batch, self.worker.submit(self.runner.execute, batch)))
            if len(self.live) == 1:
                return
        self._process_oldest()

    def _process_oldest(self) -> None:
        """Wait for the oldest launched step and process it. If running it failed, every launched step fails with it
        (a later one may read its sampled ids); see Scheduler.fail_batches for what happens to their requests."""
        batch, fut = self.live[0]
        try:
            out = (self.runner.execute(batch) if fut is None else fut.result()).wait()
        except Exception as exc:
            futures.wait([f for _, f in self.live if f is not None])
            running = list(self.scheduler.running)
            self.scheduler.fail_batches([b for b, _ in self.live], exc)
            self.tracker.discarded([b for b, _ in self.live])
            self._note_retracted(running)
            self.live.clear()
            raise
        self.live.pop(0)
        self.scheduler.process(batch, out)
        self._publish()  # the output stage detokenizes while this thread goes on to the next step
        self.tracker.processed(batch)

    def _publish(self) -> None:
        if self.scheduler.updates:
            self.publish(self.scheduler.take_updates())

    def _note_retracted(self, before: list[Any]) -> None:
        """Tell the tracker which of the requests running `before` are back in the queue."""
        waiting = {id(r) for r in self.scheduler.waiting}
        for req in before:
            if id(req) in waiting:
                self.tracker.retracted(req)

    def drain_inbox(self, block: bool) -> None:
        try:
            msg = self.inbox.get(timeout=IDLE_WAIT_S) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = msg[0]
            if kind == "add":  # a call's requests, together (RequestPath._submit_all)
                for req in msg[1]:
                    self.scheduler.add(req)
            elif kind == "abort":
                self.scheduler.abort(msg[1])
            elif kind == "end":  # from the output stage: a stop string matched, or the request's output failed
                self.scheduler.end(msg[1], msg[2], msg[3])
            elif kind == "call":
                fn, fut = msg[1], msg[2]
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                    fut.set_exception(exc)
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return

    def fail_all(self, exc: BaseException) -> None:
        """The loop died: every request it holds or has not taken in yet ends with `exc` (after what it was sent)."""
        reqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "add":
                reqs.extend(msg[1])
            elif msg[0] == "call":
                msg[2].set_exception(exc)
        updates = self.scheduler.take_updates()
        self.publish(updates + [ReqUpdate(req, len(req.output_ids), error=exc) for req in reqs])

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the loop thread between steps, so it sees consistent scheduler state."""
        self.check_alive()
        fut: Future[Any] = Future()
        self.inbox.put(("call", fn, fut))
        return fut.result()

    def post(self, fn: Callable[[], Any]) -> None:
        """Run fn on the loop thread between steps without waiting for it; a failure is logged (nobody waits)."""
        self.check_alive()
        fut: Future[Any] = Future()
        fut.add_done_callback(_log_failure)
        self.inbox.put(("call", fn, fut))

    def check_alive(self) -> None:
        if self.error is not None or not self.thread.is_alive():
            raise EngineDeadError(f"engine is not running: {self.error!r}")


def _log_failure(fut: Future[Any]) -> None:
    exc = fut.exception()
    if exc is not None:
        log.error("a call posted to the engine loop failed: %r", exc)
