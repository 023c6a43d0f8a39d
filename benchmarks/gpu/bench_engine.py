"""Engine-level GPU benchmarks: GPU idle time during steady decode (overlap on/off), and the shared-prefix workload
with the radix cache on and off (throughput and TTFT).

Idle time comes from a profiler trace of a window of pure decode steps: the union of kernel/memcpy/memset intervals
over the window's span; what is not covered is time the GPU waited (on Python, launches, or syncs).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def busy_fraction(trace: dict[str, Any]) -> tuple[float, float]:
    """(fraction of the trace's span covered by GPU work, span in ms) from a Chrome trace of torch.profiler."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_EVENT_CATEGORIES
    )
    if not gpu:
        raise RuntimeError("the profiler recorded no GPU activity")
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e["dur"]) for e in events)
    busy, cur_start, cur_end = 0.0, gpu[0][0], gpu[0][1]
    for s, e in gpu[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    return busy / (end - start), (end - start) / 1e3


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def decode_idle(
    device: torch.device,
    model_dir: Path,
    overlap: bool,
    num_requests: int,
    prompt_len: int,
    new_tokens: int,
    profile_s: float,
    backend: str,
    profile_out: Path | None = None,
) -> dict[str, Any]:
    """Time, then profile, `profile_s` seconds each of steady decode of `num_requests` requests; with
    `profile_out`, also a cProfile of the loop's schedule/process and the runner's execute, written there."""
    from radixserve import Engine

    kwargs: dict[str, Any] = dict(
        model=model_dir,
        dtype="bfloat16",
        device=str(device),
        attention_backend=backend,
        max_running_requests=num_requests,
        overlap_schedule=overlap,
        max_total_tokens=num_requests * (prompt_len + new_tokens + 32),
    )
    rng = random.Random(0)
    top = min(vocab_size(model_dir), 4000)
    prompts = [[rng.randrange(3, top) for _ in range(prompt_len)] for _ in range(num_requests)]
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with Engine(**kwargs) as eng:
        eng.generate(input_ids=[[5] * 16] * 4, sampling_params={"max_new_tokens": 4})  # warm-up
        done: list[Any] = []
        worker = threading.Thread(target=lambda: done.append(eng.generate(input_ids=prompts, sampling_params=params)))
        worker.start()
        total_prompt = num_requests * prompt_len
        while True:  # wait for pure decode: every prompt computed and a few tokens out
            m = eng.metrics()
            if (
                m["num_waiting"] == 0
                and m["generation_tokens_total"] >= 4 * num_requests + 4
                and m["computed_prefill_tokens_total"] >= total_prompt
            ):
                break
            if not worker.is_alive():
                raise RuntimeError("generation ended before steady decode was reached; raise new_tokens")
            time.sleep(0.02)
        timers = time_phases(eng)
        before = eng.metrics()["generation_tokens_total"]
        t0 = time.perf_counter()
        time.sleep(profile_s)  # first the speed without a profiler
        wall = time.perf_counter() - t0
        after = eng.metrics()["generation_tokens_total"]
        phases = {k: v.per_call_ms() for k, v in timers.items()}
        if profile_out is not None:  # where the host time of a step goes, function by function
            profile_out.write_text(profile_host(eng, profile_s) + "\n" + blocking_calls(0.5))
        # Then the idle fraction from a trace of device activity only: a CPU trace would slow the host side it
        # is meant to judge.
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            time.sleep(profile_s)
        end = eng.metrics()["generation_tokens_total"]
        worker.join()
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            busy, span_ms = busy_fraction(json.loads(path.read_text()))
    if end - before >= num_requests * (new_tokens - 4):
        raise RuntimeError("the measured windows reached the end of generation; raise new_tokens")
    steps = (after - before) / num_requests
    return {
        "bench": f"decode idle, {num_requests} reqs",
        "overlap": overlap,
        "backend": backend,
        "gpu_idle": 1 - busy,
        "span_ms": span_ms,
        "steps": steps,
        "ms_per_step": wall * 1e3 / max(steps, 1),
        "tok/s": (after - before) / wall,
        **{f"{k}_ms": v for k, v in phases.items()},
    }


def profile_host(eng: Any, seconds: float, top: int = 30) -> str:
    """cProfile (cumulative, top functions) of the scheduler's and runner's host code for `seconds` of steps."""
    import cProfile
    import io
    import pstats

    profs: list[cProfile.Profile] = []
    lock, active = threading.Lock(), threading.Lock()

    def profiled(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            # Python 3.12+ allows one active profiler per process: a call overlapping another thread's profiled
            # call runs unprofiled (so with overlap on, this shows a sample of each phase, not every call).
            if not active.acquire(blocking=False):
                return fn(*args, **kwargs)
            prof = cProfile.Profile()
            prof.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                prof.disable()
                active.release()
                with lock:
                    profs.append(prof)

        return call

    sched, runner = eng.scheduler, eng.runner
    saved = sched.schedule, sched.process, runner.execute
    sched.schedule, sched.process, runner.execute = (profiled(f) for f in saved)
    time.sleep(seconds)
    sched.schedule, sched.process, runner.execute = saved
    with lock:
        out = io.StringIO()
        stats = pstats.Stats(profs[0], stream=out)
        for prof in profs[1:]:
            stats.add(prof)
    stats.sort_stats("cumulative").print_stats(top)
    return f"{len(profs)} calls profiled\n" + out.getvalue()


def blocking_calls(seconds: float, top: int = 15) -> str:
    """CUDA runtime/driver calls and CPU ops by total host time over `seconds` of steps (a CPU+CUDA trace): a
    synchronising call (a pageable copy, a stream or event sync) shows as one that lasts about a step."""
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        time.sleep(seconds)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    lines = []
    for cats in (("cuda_runtime", "cuda_driver"), ("cpu_op",)):
        agg: dict[str, list[float]] = {}
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in cats:
                agg.setdefault(e["name"], []).append(float(e.get("dur", 0)))
        lines.append(f"{'/'.join(cats)}: name, calls, total ms, max us")
        for name, durs in sorted(agg.items(), key=lambda kv: -sum(kv[1]))[:top]:
            lines.append(f"  {name[:70]:70s} {len(durs):6d} {sum(durs) / 1e3:9.2f} {max(durs):9.0f}")
    return "\n".join(lines) + "\n"


class PhaseTimer:
    """Wraps a callable; accumulates its wall time and calls."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.total, self.calls = fn, 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t0
            self.calls += 1

    def per_call_ms(self) -> float:
        return self.total * 1e3 / max(self.calls, 1)


def time_phases(eng: Any) -> dict[str, PhaseTimer]:
    """Host time per step of the loop thread's schedule and process, and of the runner's execute (the worker's,
    with overlap): where a step's milliseconds go when the GPU waits. Counts from now on."""
    timers = {
        "schedule": PhaseTimer(eng.scheduler.schedule),
        "process": PhaseTimer(eng.scheduler.process),
        "execute": PhaseTimer(eng.runner.execute),
    }
    eng.scheduler.schedule, eng.scheduler.process, eng.runner.execute = (
        timers["schedule"],
        timers["process"],
        timers["execute"],
    )
    return timers


def shared_prefix(
    device: torch.device,
    model_dir: Path,
    cache: bool,
    groups: int,
    per_group: int,
    system_len: int,
    question_len: int,
    answer_len: int,
    backend: str,
    max_running: int,
) -> dict[str, Any]:
    """`groups` system prompts, each shared by `per_group` requests with their own question; all submitted at once."""
    from radixserve import Engine

    rng, top = random.Random(1), min(vocab_size(model_dir), 4000)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(3, top) for _ in range(system_len)]
        prompts += [system + [rng.randrange(3, top) for _ in range(question_len)] for _ in range(per_group)]
    params = {"max_new_tokens": answer_len, "temperature": 0, "ignore_eos": True}
    budget = max_running * (system_len + question_len + answer_len + 32) + groups * system_len
    with Engine(
        model=model_dir,
        dtype="bfloat16",
        device=str(device),
        attention_backend=backend,
        enable_radix_cache=cache,
        max_running_requests=max_running,
        max_total_tokens=budget,
    ) as eng:
        eng.generate(input_ids=[[5] * 16] * 4, sampling_params={"max_new_tokens": 4})  # warm-up
        eng.flush_cache()
        m0 = eng.metrics()
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        wall = time.perf_counter() - t0
        m1 = eng.metrics()
    ttft = sorted(o["meta_info"]["ttft"] for o in outs)
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "bench": f"shared prefix {groups}x{per_group}, {system_len}+{question_len} -> {answer_len}",
        "cache": "on" if cache else "off",
        "backend": backend,
        "wall_s": wall,
        "out_tok/s": out_tokens / wall,
        "total_tok/s": (out_tokens + prompt_tokens) / wall,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p50_s": ttft[len(ttft) // 2],
        "ttft_p90_s": ttft[int(len(ttft) * 0.9)],
        "prefill_computed": m1["computed_prefill_tokens_total"] - m0["computed_prefill_tokens_total"],
        "hit_rate": (m1["cached_tokens_total"] - m0["cached_tokens_total"])
        / max(m1["prompt_tokens_total"] - m0["prompt_tokens_total"], 1),
    }
