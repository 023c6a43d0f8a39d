"""A tensor-parallel worker rank: loads its shard of the model and of the KV pool, then runs every forward rank 0
broadcasts until rank 0 stops (radixserve/distributed.py).

`python -m radixserve.tp_worker SETTINGS_JSON [...]` with torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) set: rank 0 starts it so. Under torchrun itself no one runs this module: the Engine of a
rank above 0 calls `run_worker` and exits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from radixserve.distributed import TPGroup, join, start, torchrun_env
from radixserve.errors import ParamError
from radixserve.model.loader import read_config
from radixserve.model.parallel import plan_shard
from radixserve.model.runner import ModelRunner


def worker_settings(
    model_path: str,
    dtype: str,
    device: str,
    page_size: int,
    max_total_tokens: int | None,
    attention_backend: str,
    max_running_requests: int,
    context_length: int | None,
    quantization: str,
    kv_cache_dtype: str = "auto",
    kv_cache_bytes: int | None = None,
) -> dict[str, Any]:
    """The ModelRunner settings every rank must share, as JSON-safe values (what rank 0 passes to its workers)."""
    return dict(
        model_path=model_path,
        dtype=dtype,
        device=device,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        attention_backend=attention_backend,
        max_running_requests=max_running_requests,
        context_length=context_length,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_bytes=kv_cache_bytes,
    )


def start_tensor_parallel(size: int, settings: dict[str, Any]) -> TPGroup | None:
    """Rank 0's group over `size` ranks (None for 1), its workers started; the split is checked first, so a model
    whose heads cannot split over `size` raises ParamError('tp') before any process starts. Under torchrun, on a
    rank above 0, this serves rank 0's steps and exits the process (SystemExit(0)) instead of returning."""
    if size == 1:
        return None
    if settings["quantization"] != "none":
        raise ParamError(
            "tp",
            f"tensor parallelism with quantization {settings['quantization']!r} is not supported "
            "yet: use quantization 'none' (or 'auto') with tp > 1",
        )
    try:
        plan_shard(read_config(Path(settings["model_path"])), size)
    except ValueError as e:
        raise ParamError("tp", str(e)) from e
    tp = start(size, torch.device(settings["device"]), [json.dumps(settings)])
    if tp is not None and tp.rank > 0:
        run_worker(tp, settings)
        raise SystemExit(0)
    return tp


def run_worker(tp: TPGroup, *settings: dict[str, Any]) -> None:
    """Load this rank's shard and serve rank 0's steps until rank 0 stops; with several settings, one model after
    the other (rank 0 ends each but the last with `TPGroup.send_stop`). Leaves the group at the end."""
    try:
        for s in settings:
            kw = {k: v for k, v in s.items() if k != "device"}
            kw["dtype"] = getattr(torch, s["dtype"])
            ModelRunner(device=tp.device, cuda_graph=False, tp=tp, **kw).serve_steps()
    finally:
        tp.close()


def main(argv: list[str]) -> int:
    env = torchrun_env()
    if env is None or not argv:
        print(
            "usage: RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python -m radixserve.tp_worker "
            "SETTINGS_JSON [SETTINGS_JSON ...]",
            file=sys.stderr,
        )
        return 2
    settings = [json.loads(a) for a in argv]
    rank, size, local_rank = env
    try:
        run_worker(join(rank, size, local_rank, torch.device(settings[0]["device"])), *settings)
    except RuntimeError as e:  # above all rank 0 gone (gloo: "Connection closed by peer"): one line, not a traceback
        print(f"radixserve tp worker rank {rank}: stopped: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
