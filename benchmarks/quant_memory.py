"""Peak resident memory (VmHWM) of a fresh process that builds the default model's Engine in each weight format and
generates a few tokens, KV pool fixed at 4,096 tokens, one process per configuration (issue 14's memory goal).

    .venv/bin/python -m benchmarks.quant_memory [--configs bfloat16:none auto:auto bfloat16:int8 bfloat16:int4]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CODE = """
import sys
from radixserve import Engine
dtype, quant = sys.argv[1].split(":")
with Engine(dtype=dtype, quantization=quant, max_total_tokens=4096) as eng:
    eng.generate(input_ids=list(range(1000, 1064)), sampling_params={"max_new_tokens": 8, "temperature": 0})
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    print(eng.model_info()["quantization"], int(status["VmHWM"].split()[0]) // 1024, int(status["VmRSS"].split()[0]) // 1024)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=["bfloat16:none", "auto:auto", "bfloat16:int8", "bfloat16:int4"])
    a = ap.parse_args()
    print("| dtype:quantization | resolved | peak RSS MiB (VmHWM) | RSS after MiB |\n|---|---|---|---|")
    for conf in a.configs:
        out = subprocess.run([sys.executable, "-c", CODE, conf], capture_output=True, text=True, check=True)
        quant, peak, rss = out.stdout.split()[-3:]
        print(f"| {conf} | {quant} | {peak} | {rss} |", flush=True)


if __name__ == "__main__":
    main()
