"""API keys: entries from --api-key, the key file and RADIXSERVE_API_KEYS; roles and limits; errors at start-up; reload
(with SIGHUP in a real process); only digests in memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest

from server_process import wait_healthy
from test_server_launch import free_port
from radixserve.cli import main
from radixserve.server.tenants import (
    OPEN,
    ApiKeyError,
    KeyRing,
    KeySources,
    Limits,
    parse_file,
    tenant_of,
)

REPO = Path(__file__).resolve().parents[1]
STREAM_TOKENS = 900

KEY_FILE = """\
# tenants of the shared deployment
sk-alice name=alice max_concurrent=2 max_queued=4 tokens_per_minute=1000
sk-ops   name=ops role=admin   # the operator
sk-bob                          # no name: named by a digest prefix, role user
sk-#hash name=hash

"""


def test_key_file_entries_roles_and_limits() -> None:
    alice, ops, bob, hashed = (e.principal for e in parse_file(KEY_FILE, "keys.txt"))
    assert hashed.name == "hash" and hashed.namespace == tenant_of("sk-#hash")  # '#' inside a key is no comment
    assert (alice.name, alice.role, alice.limits) == ("alice", "user", Limits(2, 4, 1000))
    assert (ops.name, ops.role, ops.limits) == ("ops", "admin", Limits())
    assert bob.role == "user" and bob.name.startswith("key-") and "sk-bob" not in bob.name
    assert alice.namespace == tenant_of("sk-alice") != bob.namespace


def test_command_line_and_environment_keys_are_admin_unless_they_say_so(tmp_path: Path) -> None:
    src = KeySources(cli=("sk-a, sk-b name=bee role=user", "sk-c"), env="sk-d\nsk-e role=user\n")
    roles = {p.name: p.role for p in KeyRing(src).principals}
    assert sorted(roles.values()) == ["admin", "admin", "admin", "user", "user"] and roles["bee"] == "user"
    ring = KeyRing.from_keys("k1,k2")
    assert [p.role for p in ring.principals] == ["admin", "admin"]


@pytest.mark.parametrize(
    "sources, message",
    [
        (KeySources(cli=("",)), "empty API key"),
        (KeySources(cli=("a,,b",)), "empty API key"),
        (KeySources(cli=("name=x",)), "empty API key"),
        (KeySources(env=""), "empty API key"),
        (KeySources(env="a\n\nb"), "empty API key"),
        (KeySources(cli=("a role=root",)), "role must be admin or user"),
        (KeySources(cli=("a max_concurrent=0",)), "max_concurrent must be an integer >= 1"),
        (KeySources(cli=("a colour=red",)), "unknown option 'colour'"),
        (KeySources(cli=("a name",)), "is not name=value"),
        (KeySources(cli=("a", "a")), "given twice"),
        (KeySources(cli=("a name=x", "b name=x")), "two keys are named 'x'"),
        (KeySources(file=Path("/nonexistent/keys")), "No such file"),
    ],
)
def test_bad_keys_are_start_up_errors(sources: KeySources, message: str) -> None:
    with pytest.raises(ApiKeyError, match=message):
        KeyRing(sources)


def test_only_digests_are_kept_and_lookup_matches_exactly() -> None:
    ring = KeyRing.from_keys(["sk-secret-one", "sk-secret-two name=two role=user"])
    assert "sk-secret" not in repr(ring.__dict__)
    assert ring.lookup(b"sk-secret-two").name == "two"
    assert ring.lookup(b"sk-secret-one").role == "admin"
    for wrong in (b"", b"sk-secret", b"sk-secret-one ", b"SK-SECRET-ONE"):
        assert ring.lookup(wrong) is None


def test_can_see() -> None:
    alice = next(e.principal for e in parse_file(KEY_FILE, "k") if e.principal.name == "alice")
    ops = next(e.principal for e in parse_file(KEY_FILE, "k") if e.principal.name == "ops")
    ns = alice.namespace
    assert alice.can_see(ns) and alice.can_see(ns + "|my-salt")
    assert not alice.can_see(tenant_of("sk-bob")) and not alice.can_see("") and not alice.can_see(ns + "x")
    assert ops.can_see(ns) and ops.can_see("") and OPEN.can_see(ns)


def test_reload_swaps_keys_and_keeps_them_on_a_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("sk-old name=old\n")
    ring = KeyRing(KeySources(cli=("sk-admin",), file=path))
    assert ring.lookup(b"sk-old").name == "old"
    path.write_text("sk-new name=new role=admin\n")
    assert ring.reload()
    assert ring.lookup(b"sk-old") is None and ring.lookup(b"sk-new").role == "admin"
    assert ring.lookup(b"sk-admin") is not None  # command-line keys stay
    path.write_text("sk-broken role=boss\n")
    assert not ring.reload()  # logged; the keys in force stay
    assert ring.lookup(b"sk-new") is not None
    ring.reload_in_background()  # what SIGHUP runs: off the signal handler
    assert "new" in ring.describe() and "sk-" not in ring.describe()


def _fake_launch(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []
    fake = types.ModuleType("radixserve.server.launch")
    fake.run_server = lambda *args, **kwargs: calls.append((args, kwargs))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "radixserve.server.launch", fake)
    return calls


def test_cli_keys_from_flags_file_and_environment(tiny_model_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    calls = _fake_launch(monkeypatch)
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    monkeypatch.setenv("RADIXSERVE_API_KEYS", "sk-env")
    argv = [
        "serve",
        "--model",
        str(tiny_model_dir),
        "--api-key",
        "sk-1,sk-2",
        "--api-key",
        "sk-3",
        "--api-key-file",
        str(path),
        "--shutdown-grace-seconds",
        "7",
    ]
    assert main(argv) == 0
    ((args, kwargs),) = calls
    keys = args[3]
    assert keys.cli == ("sk-1,sk-2", "sk-3") and keys.env == "sk-env" and keys.file == path
    assert len(keys.load()) == 8 and kwargs["grace_period_s"] == 7.0
    for bad in (["--api-key", ""], ["--api-key-file", str(tmp_path / "missing")], ["--api-key", "a role=x"]):
        assert main(["serve", "--model", str(tiny_model_dir), *bad]) == 2
        assert capsys.readouterr().err.startswith("radixserve: error: ")
    monkeypatch.setenv("RADIXSERVE_API_KEYS", "")
    assert main(["serve", "--model", str(tiny_model_dir)]) == 2  # set but empty: not silently open
    assert len(calls) == 1


def _stream(url: str, key: str, out: list, started: threading.Event) -> None:
    """A streamed completion of STREAM_TOKENS tokens; appends (status, completion tokens of the last chunk). Events
    are split on blank lines, not read as lines: random text holds characters that str.splitlines breaks on."""
    body = {"prompt": "hi", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    headers = {"Authorization": f"Bearer {key}"}
    data = b""
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        for piece in r.iter_bytes():
            started.set()
            data += piece
    started.set()
    events = [json.loads(e[6:]) for e in data.decode().split("\n\n") if e.startswith("data: {")]
    out.append((r.status_code, events[-1]["usage"]["completion_tokens"] if events else None))


@pytest.mark.slow
def test_sighup_reloads_the_key_file_of_a_running_server(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Under load: streams run (one of them with the key the reload removes) and a kept key keeps asking while the
    file is rewritten and reloaded; every stream ends whole, the kept key is never refused."""
    path = tmp_path / "keys"
    path.write_text("sk-first name=first\nsk-keep name=keep\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RADIXSERVE_API_KEYS", None)
    port = free_port()  # a fixed range once collided with another server's port
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "radixserve.cli",
            "serve",
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--port",
            str(port),
            "--api-key-file",
            str(path),
            "--max-total-tokens",
            "4096",
        ],
        cwd=str(REPO),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(proc, url, timeout=120, poll_s=0.2)

        def status(key: str) -> int:
            return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code

        assert (status("sk-first"), status("sk-second")) == (200, 401)
        results: list = []
        streams = []
        for key in ("sk-first", "sk-keep", "sk-keep"):
            started = threading.Event()
            streams.append(threading.Thread(target=_stream, args=(url, key, results, started)))
            streams[-1].start()
            assert started.wait(60)
        path.write_text("sk-second name=second\nsk-keep name=keep\n")
        proc.send_signal(signal.SIGHUP)
        assert all(t.is_alive() for t in streams)  # the reload runs under load
        deadline = time.monotonic() + 10
        while status("sk-second") != 200:
            assert status("sk-keep") == 200  # never refused while the file is swapped
            assert time.monotonic() < deadline, "SIGHUP did not reload the key file"
            time.sleep(0.1)
        assert status("sk-first") == 401 and proc.poll() is None
        for t in streams:
            t.join(300)
        assert results == [(200, STREAM_TOKENS)] * 3  # admitted before the reload: served to the end
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
