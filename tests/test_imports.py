"""The shipped packages import as a tree: no module of eyas_common or a stage reaches itself again through its
imports, lazy ones inside functions included (a cycle is what forced those lazy imports in the first place)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = [REPO / "common" / "eyas_common", *sorted((REPO / "stages").glob("*/eyas_*")), REPO / "testing" / "eyas_testing"]


def module_files() -> dict[str, Path]:
    """eyas module name -> its file, for every package above."""
    out = {}
    for pkg in PACKAGES:
        for f in pkg.rglob("*.py"):
            parts = f.relative_to(pkg.parent).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The eyas modules `name` imports, at the top or inside a function; `from pkg import sub` counts as pkg.sub."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & known.keys()
            found |= subs or {node.module}
    return {m for m in found if m in known and m != name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n, path + [n])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m, [m])):
            return found
    return None


def test_no_import_cycles():
    known = module_files()
    graph = {m: imports(m, f, known) for m, f in known.items()}
    assert len(graph) > 60 and graph["eyas_train.train"] >= {"eyas_train.state", "eyas_common.contract"}
    assert cycle(graph) is None, " -> ".join(cycle(graph) or [])


def test_a_cycle_is_found():
    """The checker itself: a lazy import back (contract -> lock -> contract, as it was) is a cycle."""
    graph = {"a.contract": {"a.lock"}, "a.lock": {"a.contract"}, "a.cli": {"a.lock"}}
    found = cycle(graph)
    assert found is not None and set(found) == {"a.contract", "a.lock"} and found[0] == found[-1], found
    assert cycle({"a.cli": {"a.lock"}, "a.lock": {"a.contract"}, "a.contract": set()}) is None
