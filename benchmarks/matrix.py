"""The feature matrix (issue 32): one fixed workload under combinations of settings, every output compared with one
reference run. In float32 with no quantization every combination must give the reference's tokens exactly and its
logprobs within 1e-4. The deterministic leg (issue 39: `deterministic=True`, bf16 activations, int8 weights, the
default CPU setting where bf16 hardware exists) must give its reference's tokens and logprobs bit for bit, with no
near-tie exemption; the GGUF's own blocks (issue 38) join that leg the same way, also as `gguf-dense` (the dense
path of AMX CPUs from 8 rows, which the mode must switch off). Retention (issue 37) only reorders
eviction, so its rows must give the float32 reference's tokens. int8 and GGUF combinations without the mode must
run cleanly (no error, no leak, invariants hold) and their divergence from the single-rank run with the same weights
is reported, not asserted: there our int8 kernels take a different path by the number of rows in a step (1-2, 3-47,
48+), so a row's sums depend on the step's shape and tokens drift; the GGUF kernels round activations to int8,
which turns a float32 difference upstream into a near-tie flip now and then.

    python -m benchmarks.matrix --out /tmp/matrix.json [--pairwise] [--limit N]

The normal test suite (tests/test_matrix.py) runs a covering array, every pair of settings at least once; this
script runs the product (see `product`) or the covering array and prints the count, the wall time and every
mismatch. Each combination runs benchmarks/matrix_workload.py in a process of its own, on one of the three tiny
models in turn (every model meets every setting across the rows; the references are per model).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FACTORS: dict[str, list[Any]] = {
    "tp": [1, 2],
    "page_size": [16, 1],
    "partial": [True, False],
    "radix": [True, False],
    "speculative": ["off", "ngram"],
    "tier": ["off", "host", "disk"],
    "overlap": [False, True],
    "cpu_kernels": [True, False],
    "backend": ["torch", "triton"],
    # gguf: the tiny model written as a GGUF of 32-value blocks, run on the file's own blocks (issue 38); gguf-dense:
    # the same with the dense path a CPU with AMX takes (radixserve/model/gguf_linear.py) from 8 rows, on any CPU
    "quantization": ["none", "int8", "gguf", "gguf-dense"],
    "deterministic": [False, True],
    # KV pages as the model's dtype (float32 here), int8 (radixserve/cache/kv_format.py), or bfloat16 under the
    # float32 activations (what auto stores on a CPU without bf16 hardware: radixserve/model/cpu_select.py)
    "kv_dtype": ["auto", "int8", "bfloat16"],
    # every request asks for retention (retention_seconds + retention_priority, issue 37): only the eviction order
    # changes, never a token
    "retention": [False, True],
}
REFERENCE = {name: values[0] for name, values in FACTORS.items()}
GGUF = ("gguf", "gguf-dense")  # the quantization values that run the GGUF twin
LOGPROB_TOL = 1e-4
# int8 or bfloat16 KV pages against the reference on the same pages: a float32 rounding difference upstream (TP's
# split sums, the Triton kernels' order) can move a K or V value across a rounding boundary, which changes it by a
# whole step (int8: 1/127 of its row's largest value; bfloat16: 2^-8 of the value), far above float32 rounding;
# tokens must still be identical. Measured worst with int8: 1.4e-4.
KV_ROUNDED_LOGPROB_TOL = 1e-3


def allowed(combo: dict[str, Any]) -> bool:
    """Combinations the engine refuses, by design: n-gram drafts need overlap off (radixserve/speculative/mode.py);
    int8 weights do not run under tensor parallelism yet (their row-parallel sum is not built: docs/parallel.md),
    nor do the GGUF blocks (a CPU path, unsharded: radixserve/model/loader.py); deterministic mode needs int8
    weights or the GGUF blocks, the CPU kernels and one rank (radixserve/model/deterministic.py), and its leg here runs on the torch
    backend only (triton's, whose bits differ and would need a reference of their own, is
    tests/test_deterministic_triton.py). `combo` may name only some factors."""
    if combo.get("speculative") == "ngram" and combo.get("overlap") is True:
        return False
    if combo.get("quantization") in ("int8", *GGUF) and combo.get("tp", 1) > 1:
        return False
    return not combo.get("deterministic") or (
        combo.get("quantization", "int8") in ("int8", *GGUF)
        and combo.get("cpu_kernels", True)
        and combo.get("backend", "torch") == "torch"
        and combo.get("tp", 1) == 1
    )


def tolerance(combo: dict[str, Any]) -> float | None:
    """How far `combo`'s logprobs may be from its reference's (its tokens must be equal), or None when the
    comparison is only reported: int8 or GGUF weights without deterministic mode (the GGUF kernels' rows are
    batch-invariant, but they round activations to int8, so a float32 difference upstream, such as the Triton
    kernels' order, can flip a rounding and then a near-tie token: measured once in the covering array)."""
    if combo["deterministic"]:
        return 0.0
    if combo["quantization"] != "none":
        return None
    return KV_ROUNDED_LOGPROB_TOL if combo["kv_dtype"] != "auto" else LOGPROB_TOL


def product() -> list[dict[str, Any]]:
    """Every allowed combination of the float32 torch-backend settings and of the deterministic leg's, less the
    ones that cannot differ from another (partial-page reuse at page size 1, where no page is partial; tiers without
    the radix cache, which they hang under), then the covering array's rows with the Triton interpreter, int8 or
    GGUF weights without the mode, int8 KV pages or retention (a subset, as the interpreter takes a minute a
    model)."""
    names = list(FACTORS)
    combos = [dict(zip(names, values)) for values in itertools.product(*FACTORS.values())]
    core = [
        c
        for c in combos
        if allowed(c)
        and c["backend"] == "torch"
        and (c["quantization"] == "none" or c["deterministic"])
        and c["kv_dtype"] == "auto"
        and not c["retention"]
        and not (c["page_size"] == 1 and not c["partial"])
        and not (not c["radix"] and c["tier"] != "off")
    ]
    rest = [
        r
        for r in pairwise()
        if r["backend"] != "torch"
        or (r["quantization"] != "none" and not r["deterministic"])
        or r["kv_dtype"] != "auto"
        or r["retention"]
    ]
    return core + rest


def pairwise() -> list[dict[str, Any]]:
    """A covering array: every allowed pair of values of two factors appears in at least one combination. Greedy
    (AETG-style, deterministic): each new row starts from the reference and takes, factor by factor, the value
    covering the most pairs still missing."""
    names = list(FACTORS)
    missing = {
        ((a, va), (b, vb))
        for a, b in itertools.combinations(names, 2)
        for va in FACTORS[a]
        for vb in FACTORS[b]
        if allowed({a: va, b: vb})
    }
    rows: list[dict[str, Any]] = []
    while missing:
        (a, va), (b, vb) = min(missing, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), str(p)))
        row = {a: va, b: vb}
        for name in names:
            if name in row:
                continue
            options = [v for v in FACTORS[name] if allowed({**row, name: v})]

            def gain(v: Any, name: str = name) -> int:
                return sum(((n, row[n]), (name, v)) in missing or ((name, v), (n, row[n])) in missing for n in row)

            row[name] = max(options, key=gain)
        if not allowed(row):
            row = {**REFERENCE, a: va, b: vb}
        rows.append({n: row[n] for n in names})
        missing -= {((x, row[x]), (y, row[y])) for x, y in itertools.combinations(names, 2)}
    return rows


def run_combo(combo: dict[str, Any], models: list[Path], timeout: float = 900) -> dict[str, Any]:
    """The workload's outputs under `combo`, from a process of its own. GGUF weights run each model's GGUF twin
    (tests/matrix_models.py writes it beside the folder)."""
    if combo["quantization"] in GGUF:
        models = [m.with_suffix(".gguf") for m in models]
    env = {**os.environ, "RADIXSERVE_CPU_KERNELS": "1" if combo["cpu_kernels"] else "0"}
    # the integer kernels, or the dense path from 8 rows (the workload's prefill chunks are 32 tokens), on any CPU
    env["RADIXSERVE_GGUF_DENSE_ROWS"] = "8" if combo["quantization"] == "gguf-dense" else "0"
    if combo["backend"] == "triton":
        env.setdefault("TRITON_INTERPRET", "1")  # on CPU the Triton kernels run in the interpreter
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, "-m", "benchmarks.matrix_workload", json.dumps(combo), out.name, *map(str, models)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{combo}: the workload failed:\n{proc.stderr[-4000:]}")
        return json.loads(Path(out.name).read_text())


def compare(got: Any, want: Any, tol: float, where: str = "") -> list[str]:
    """Every difference between two workload outputs: ids must be equal, logprobs within `tol`."""
    if isinstance(want, dict) and "ids" in want:
        if got["ids"] != want["ids"]:
            return [f"{where}: ids {got['ids']} != {want['ids']}"]
        worst = max((abs(g - w) for g, w in zip(got["logprobs"], want["logprobs"])), default=0.0)
        return [f"{where}: logprob differs by {worst:.2e}"] if worst > tol else []
    if isinstance(want, dict):
        return [d for k in want for d in compare(got.get(k), want[k], tol, f"{where}/{k}")]
    if isinstance(want, list) and want and isinstance(want[0], dict):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in compare(g, w, tol, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def reference_of(combo: dict[str, Any]) -> dict[str, Any]:
    """The run `combo` is compared with: the float32 reference, or for int8 or GGUF weights the single-rank run with
    those weights (same cpu kernel setting: without them int8 runs a pure-torch path of other roundings and GGUF a
    dequantized float matmul; same deterministic setting). Retention rows have the reference without retention.
    int8 (or bfloat16) KV pages are compared with the reference run on the same pages: their rounding changes the
    logits, so the float32 KV run is no reference."""
    ref = {**REFERENCE, "kv_dtype": combo["kv_dtype"]}
    if combo["quantization"] == "none":
        return ref
    return {
        **ref,
        "quantization": combo["quantization"],
        "cpu_kernels": combo["cpu_kernels"],
        "deterministic": combo["deterministic"],
    }


def run_matrix(combos: list[dict[str, Any]], models: list[Path]) -> dict[str, Any]:
    """Run every combination (the i-th on models[i % len(models)]) against its reference; failures by combination
    (float32 mismatches, any error), int8 divergences as notes, seconds per combination."""
    refs: dict[str, Any] = {}
    report: dict[str, Any] = {"combinations": len(combos), "failures": {}, "int8_notes": {}, "seconds": []}
    t0 = time.perf_counter()
    for i, combo in enumerate(combos):
        model = models[i % len(models)]
        ref = reference_of(combo)
        key = json.dumps([ref, str(model)], sort_keys=True)
        t1 = time.perf_counter()
        try:
            if key not in refs:
                refs[key] = run_combo(ref, [model])
            tol = tolerance(combo)
            diffs = compare(run_combo(combo, [model]), refs[key], LOGPROB_TOL if tol is None else tol)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            report["failures"][json.dumps(combo)] = [repr(exc)[-2000:]]
            diffs, tol = [], None
        report["seconds"].append(time.perf_counter() - t1)
        if diffs:
            report["int8_notes" if tol is None else "failures"][json.dumps(combo)] = diffs[:20]
        ok = json.dumps(combo) not in report["failures"]
        print(f"[{i + 1}/{len(combos)}] {'ok' if ok else 'FAILED'} {model.name} {combo}", flush=True)
    report["wall_s"] = time.perf_counter() - t0
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pairwise", action="store_true", help="the covering array only (what CI runs)")
    ap.add_argument("--limit", type=int, default=None, help="the first N combinations (a smoke run)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "radixserve-matrix")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from matrix_models import build_models

    models = build_models(args.workdir)
    combos = (pairwise() if args.pairwise else product())[: args.limit]
    report = run_matrix(combos, models)
    args.out.write_text(json.dumps(report, indent=1))
    print(
        f"{report['combinations']} combinations in {report['wall_s']:.0f} s, {len(report['failures'])} failed, "
        f"{len(report['int8_notes'])} int8 or GGUF combinations without --deterministic diverged from their reference"
    )


if __name__ == "__main__":
    main()
