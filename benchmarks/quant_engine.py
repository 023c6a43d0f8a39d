"""Engine-level effect of `quantization` on the default model, configurations interleaved in one process: decode
tok/s (1 and 8 streams), time to first token of a 1,000-token prompt, and the model's weight bytes. Every engine is
built first, then each repeat measures every configuration in turn (this machine is shared: read the ratios, medians
of the repeats). CPU flags printed with the figures.

    .venv/bin/python -m benchmarks.quant_engine [--configs bfloat16:none bfloat16:int8 bfloat16:int4 float32:none]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402

import radixserve_kernels.cpu  # noqa: E402
from benchmarks.cpu_speed import Ours  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.model import cpu_select  # noqa: E402


def cpu_flags() -> str:
    """The SIMD flags that decide the CPU kind, from /proc/cpuinfo, with torch's capability."""
    return (
        f"flags={' '.join(radixserve_kernels.cpu.kind_flags()) or 'n/a'} torch_cpu={cpu_select.cpu_capability()} "
        f"bf16_hw={cpu_select.has_bf16_hardware()} threads={torch.get_num_threads()} torch={torch.__version__}"
    )


def weight_bytes(eng: Engine) -> int:
    """Bytes held by the model's parameters and buffers (oneDNN-packed weights counted by their logical size)."""
    model = eng.runner.model
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["bfloat16:none", "bfloat16:int8", "bfloat16:int4", "float32:none"])
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--prefill", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--speculative", default="auto", help="the engines' n-gram speculation: auto (on for CPU) or off")
    a = ap.parse_args()
    print(cpu_flags())
    print(f"auto -> {cpu_select.choose('auto', 'auto', gguf_model=True)}; speculative={a.speculative}")
    rng = random.Random(0)
    engines = {
        c: Engine(dtype=c.split(":")[0], quantization=c.split(":")[1], max_total_tokens=4096, speculative=a.speculative)
        for c in a.configs
    }
    vocab = next(iter(engines.values())).runner.config.vocab_size
    ids = [[rng.randrange(1000, vocab - 1000) for _ in range(64)] for _ in range(8)]
    long = [rng.randrange(1000, vocab - 1000) for _ in range(a.prefill)]
    runs: dict[str, list[tuple[float, float, float]]] = {c: [] for c in a.configs}
    try:
        for _ in range(a.repeats):
            for conf, eng in engines.items():
                ours = Ours(eng)
                runs[conf].append(
                    (ours.decode(ids[:1], a.new_tokens), ours.decode(ids, a.new_tokens), ours.prefill(long))
                )
        print(
            f"| dtype:quantization | decode tok/s x1 | decode tok/s x8 (total) | TTFT {a.prefill}-token prompt (s) "
            f"| prefill tok/s | weights MB |"
        )
        print("|---|---|---|---|---|---|")
        for conf, rs in runs.items():
            d1, d8, ttft = (statistics.median(r[i] for r in rs) for i in range(3))
            print(
                f"| {conf} | {d1:.1f} | {d8:.1f} | {ttft:.2f} | {a.prefill / ttft:.0f} | "
                f"{weight_bytes(engines[conf]) / 1e6:.0f} |",
                flush=True,
            )
    finally:
        for eng in engines.values():
            eng.shutdown()


if __name__ == "__main__":
    main()
