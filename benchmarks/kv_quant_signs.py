"""How far int8 KV perplexity moves by rounding alone (issue 40): the int8 engine with random signs on channels of
the keys (and queries) or of the values (and the attention output) as attention takes them. A sign flip is exact in
any dtype and leaves attention unchanged (q . k and the output are the same), but the pages then hold other rotated
rows, which round otherwise: the spread over seeds is the measure's noise for an encoding of that error.

Seed S draws two sign vectors of head_dim 64 from `torch.Generator().manual_seed(S)`, the first for keys, the
second for values; `--on k` or `v` keeps the other side's signs at +1. Each seed runs its own engine (bfloat16
weights, as benchmarks/quality.py measures).

    .venv/bin/python -m benchmarks.kv_quant_signs --on v --seeds 1 2 --ppl-tokens 4096 --text A B
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as radixserve/__init__.py, before torch loads

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from benchmarks.kv_quant import header  # noqa: E402
from benchmarks.quality import TEXT, perplexity  # noqa: E402
from radixserve import Engine  # noqa: E402
from radixserve.attention.torch_backend import TorchAttentionBackend  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--on", choices=["k", "v", "kv"], default="v")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--text", type=Path, nargs="+", default=[TEXT])
    a = ap.parse_args()
    header()
    text = "\n\n".join(p.read_text() for p in a.text)
    forward = TorchAttentionBackend.forward
    print(f"| signs on {a.on}, seed | perplexity ({a.ppl_tokens} tokens) |")
    print("|---|---|")
    try:
        for seed in a.seeds:
            gen = torch.Generator().manual_seed(seed)
            sk, sv = (torch.randint(0, 2, (64,), generator=gen).float() * 2 - 1 for _ in range(2))
            sk, sv = (s if side in a.on else torch.ones(64) for s, side in ((sk, "k"), (sv, "v")))

            def signed(self, layer_id, q, k, v, sk=sk, sv=sv):  # noqa: ANN001, ANN202
                out = forward(self, layer_id, q * sk.to(q.dtype), k * sk.to(k.dtype), v * sv.to(v.dtype))
                return out * sv.to(out.dtype)

            TorchAttentionBackend.forward = signed
            t = time.perf_counter()
            tokens = max(8192, a.ppl_tokens + 512)
            with Engine(dtype="bfloat16", quantization="none", kv_cache_dtype="int8", max_total_tokens=tokens) as eng:
                ppl = perplexity(eng, eng.tokenizer.encode(text, add_special_tokens=False)[: a.ppl_tokens])
            print(f"| {seed} | {ppl:.3f} | ({time.perf_counter() - t:.0f} s)", flush=True)
    finally:
        TorchAttentionBackend.forward = forward


if __name__ == "__main__":
    main()
