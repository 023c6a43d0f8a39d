"""The disk tier on a filesystem that really fills (issue 33): a 64 KB tmpfs mounted in a user namespace
(`unshare -rm`), so writes fail with ENOSPC part way through a page file, not by a patched call. The engine goes on
with the same greedy outputs as without the tier, turns spilling off with one warning, leaves no temporary file
behind, and its pages add up (rule 2). Skipped where user namespaces are not allowed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CHILD = """
import json, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from radixserve import Engine
from test_kv_tier_engine import POOL, prompts, run
ids = prompts(8)
with Engine(model={model!r}, dtype="float32", **POOL) as off:
    expected = run(off, ids)
with Engine(model={model!r}, dtype="float32", kv_cache_dir={mount!r}, **POOL) as on:
    same = run(on, ids) == expected and run(on, ids) == expected
    on.check_invariants()
    stats = {{k: v for k, v in on.cache_stats().items() if k.startswith("disk")}}
    files = sorted(p.name for p in __import__("pathlib").Path({mount!r}).rglob("*") if p.is_file())
print(json.dumps({{"same": same, "stats": stats, "files": files}}))
"""


def _user_namespaces_work(mount: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)])
    return probe.returncode == 0


def test_a_full_disk_turns_spilling_off_and_changes_no_output(tiny_model_dir: Path, tmp_path: Path) -> None:
    mount = tmp_path / "kv"
    mount.mkdir()
    if not _user_namespaces_work(mount):
        pytest.skip("no user namespaces here (unshare -rm)")
    code = CHILD.format(repo=str(TESTS.parent), tests=str(TESTS), model=str(tiny_model_dir), mount=str(mount))
    script = f'mount -t tmpfs -o size=64k tmpfs "{mount}" && exec "$0" -c "$1"'
    done = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, sys.executable, code], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["same"], result
    stats = result["stats"]
    assert stats["disk_pages"] > 0 and stats["disk_hit_tokens"] > 0, stats  # it spilled and served until full
    assert stats["disk_write_errors"] >= 1 and not stats["disk_writable"], stats
    assert done.stderr.count("disk full") == 1, done.stderr[-2000:]  # one warning, then spilling is off
    assert not [f for f in result["files"] if "tmp" in f], result["files"]  # no half-written page left behind
