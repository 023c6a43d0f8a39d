"""Imports run one way along the request's path (DESIGN.md): no cycle among radixserve's module-level imports, and
the stages below the scheduler (cache, model, attention, sampling) import nothing from it or from the server."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "radixserve"
MODULES = {
    ".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p for p in PKG.rglob("*.py")
}


def _target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, top_level_only: bool) -> set[str]:
    """radixserve modules that `module` imports; top_level_only skips imports inside functions (deferred imports).
    Imports under `if TYPE_CHECKING:` never run, so they are skipped."""
    path = MODULES[module]
    found: set[str] = set()
    stack = list(ast.parse(path.read_text()).body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and top_level_only:
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _target(module, path.name == "__init__.py", node)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
    return {m for m in found if m in MODULES and m != module}


def test_no_import_cycles() -> None:
    graph = {m: imports_of(m, top_level_only=True) for m in MODULES}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(n) :] + [m, n]))
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize(
    "lower", ["radixserve.cache", "radixserve.model", "radixserve.attention", "radixserve.sampling"]
)
def test_lower_stages_never_import_the_scheduler_or_server(lower: str) -> None:
    for m in (m for m in MODULES if m == lower or m.startswith(lower + ".")):
        upward = {
            i
            for i in imports_of(m, top_level_only=False)
            if i.startswith(("radixserve.scheduler", "radixserve.server"))
        }
        assert not upward, f"{m} imports {sorted(upward)}"


def test_handler_modules_are_imported_by_the_app_alone() -> None:
    """One handler module per endpoint (`*_api.py`), each on the shared base (server/handler.py, serving.py): what
    two endpoints share lives below them, never in another endpoint's module, so a request reads top to bottom."""
    handlers = {m for m in MODULES if m.startswith("radixserve.server.") and m.endswith("_api")}
    assert "radixserve.server.chat_api" in handlers and "radixserve.server.generate_api" in handlers
    for m in MODULES:
        if m == "radixserve.server.app":
            continue
        reached = imports_of(m, top_level_only=False) & handlers
        assert not reached, f"{m} imports the handler modules {sorted(reached)}; share through handler.py instead"
