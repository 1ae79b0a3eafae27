"""The modules of ``aligntax`` form a layered graph: no import cycle, counting imports anywhere in a file.

Every ``import`` / ``from ... import`` node of every module under ``src/aligntax`` counts, including the
ones inside functions (a lazy import hides a cycle at import time but still ties the two modules
together). Relative imports are resolved, and ``from aligntax.x import y`` counts as an import of the
submodule ``aligntax.x.y`` when ``y`` is one, otherwise of the package ``aligntax.x`` (its
``__init__``).

How package ``__init__`` modules count: a package ``__init__`` is a node of its own (named after the
package). Importing ``aligntax.x.y`` is an edge to ``aligntax.x.y`` only, not to the parent package
``aligntax.x``: Python runs the parent ``__init__`` first, but an ``__init__`` that only re-exports its
own submodules never closes a cycle with them unless a submodule names the package itself, which is an
explicit edge to the ``__init__`` node and is counted. So ``aligntax/x/__init__.py`` re-exporting
``aligntax.x.y`` is fine as long as nothing that ``aligntax.x.y`` reaches imports ``aligntax.x``
(rather than ``aligntax.x.something``) back. Names a package ``__init__`` resolves lazily through a
module ``__getattr__`` table are plain strings, not imports, and do not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "aligntax"


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The longest known module prefix of a dotted name (``aligntax.x.y.attr`` -> ``aligntax.x.y``)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in mods:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name if _is_package(path) else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    if node.level > 1:
                        base = base[: len(base) - (node.level - 1)]
                    base_name = ".".join(base + ([node.module] if node.module else []))
                else:
                    base_name = node.module or ""
                for alias in node.names:
                    sub = f"{base_name}.{alias.name}"
                    targets.append(sub if sub in mods else base_name)
            for target in targets:
                if target != ROOT and not target.startswith(ROOT + "."):
                    continue
                resolved = _resolve(target, mods)
                if resolved is not None and resolved != name:
                    graph[name].add(resolved)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a closed path ``[a, b, ..., a]``, or None."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == GREY:
                return stack[stack.index(nxt) :] + [nxt]
            if colour[nxt] == WHITE:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        colour[node] = BLACK
        return None

    for start in sorted(graph):
        if colour[start] == WHITE:
            found = visit(start)
            if found:
                return found
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), for the failure message."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_graph_sees_known_edges():
    graph = import_graph()
    assert "aligntax.errors" in graph["aligntax.interventions.base"] or graph["aligntax.interventions.base"]
    # a function-level import and a ``from package import submodule`` both count
    assert "aligntax.vat.metrics" in graph["aligntax.vat.runner"]
    assert "aligntax.interventions.els" in graph["aligntax.interventions.registry"]


def test_no_import_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        groups = "\n".join("  " + ", ".join(c) for c in all_cycles(graph))
        raise AssertionError(f"import cycle: {' -> '.join(cycle)}\nstrongly connected groups:\n{groups}")


def test_no_intervention_runs_the_model():
    """Interventions only describe steering (messages, kernels, hooks): nothing under
    ``aligntax.interventions`` reaches the capture, the decode loop or the decisions made before
    generating (``aligntax.activations.decisions`` runs the prefill and reads the kernels instead)."""
    graph = import_graph()
    runners = {"aligntax.activations.capture", "aligntax.activations.decisions", "aligntax.activations.recorder",
               "aligntax.generation.generate"}

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            v = todo.pop()
            for w in graph.get(v, ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    for mod in graph:
        if mod.startswith("aligntax.interventions") and mod != "aligntax.interventions":
            hit = reach(mod) & runners
            assert not hit, f"{mod} reaches {sorted(hit)}"
    assert "aligntax.interventions.base" in graph["aligntax.activations.decisions"]  # the decisions sit above
