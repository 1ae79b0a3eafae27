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
    runners = {
        "aligntax.activations.capture",
        "aligntax.activations.decisions",
        "aligntax.activations.recorder",
        "aligntax.generation.generate",
    }

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


# The packages (and top-level modules) of ``aligntax`` from the bottom up, named relative to ``aligntax``
# ("" is ``aligntax/__init__.py``). A module belongs to the longest entry its name starts with. Every
# command-line face is in the ``cli`` package at the top, above the packages it drives. A module may
# import modules of its own entry and of the layers below its own, never of another entry of its own
# layer or of a layer above.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "paths", "defaults", "hooks"),  # nothing of aligntax
    ("surprisal",),  # hooks and errors: a prompt's own surprisal, scored inside a forward
    ("runfolder",),  # errors only: the run-folder contract (atomic writes, lock, settings header, JSONL)
    ("artefacts", "wheels", "config"),  # errors only: tensors + sidecars, pinned-wheel files, YAML configs
    ("models", "data", "judges", "energy", "reports"),  # judges only score (texts, logits), never run a model
    ("interventions",),  # steering: messages, row kernels, hooks; ELS over the energy models
    ("generation",),  # chat rendering, the decode loop, prompt logits (the first-token refusal score)
    ("activations", "metrics"),  # capture + decisions before generating; pure scoring of answers
    ("bundles", "serve", "vat"),  # sharing; the server's protocol, engine and app; value alignment tax
    ("api",),  # load_model / load_intervention
    ("",),  # ``aligntax.load_model`` etc., resolved lazily from api
    ("backends",),  # vLLM: engine, evaluation source, server (reuses serve's app and engine)
    ("runs",),  # run folders: eval, knowns, mc, ELS, demo, ...
    ("lmeval",),  # lm-evaluation-harness model (api) writing run folders
    ("audit",),  # the report card of a change: eval, knowns, mc, fluency and VAT runs, paired and gated
    ("cli",),  # every command-line face: main, options (the one error path and checks), serve, vat, ...
    ("__main__",),
)


def _unit(module: str) -> str:
    """The ``LAYERS`` entry a module belongs to (its longest matching prefix), or ``"?"``."""
    rel = module.removeprefix(ROOT).removeprefix(".")
    best = "?"
    for layer in LAYERS:
        for unit in layer:
            if (rel == unit or (unit and rel.startswith(unit + "."))) and (
                best == "?" or len(unit) > len(best)
            ):
                best = unit
    return best


def test_every_module_has_a_layer():
    units = [u for layer in LAYERS for u in layer]
    assert len(units) == len(set(units))
    missing = sorted(m for m in import_graph() if _unit(m) == "?")
    assert not missing, (
        f"modules of no package in LAYERS (add the package where its imports put it): {missing}"
    )


def test_packages_import_only_downwards():
    """No module imports (anywhere in the file, inside functions too) a module of another package in its
    own layer or in a layer above it."""
    graph = import_graph()
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    bad = []
    for mod, targets in sorted(graph.items()):
        here = _unit(mod)
        for target in sorted(targets):
            there = _unit(target)
            if there != here and level[there] >= level[here]:
                bad.append(
                    f"{mod} ({here or 'aligntax'}, layer {level[here]}) imports {target} "
                    f"({there or 'aligntax'}, layer {level[there]})"
                )
    assert not bad, "imports against the package order:\n  " + "\n  ".join(bad)


def test_layer_checks_see_function_level_imports():
    graph = import_graph()
    # a lazy import inside a function counts: the command line mounts its faces inside a function
    assert "aligntax.cli.serve" in graph["aligntax.cli.main"]
    assert _unit("aligntax.cli.serve") == "cli" and _unit("aligntax.serve.engine") == "serve"
    assert (
        _unit("aligntax.cli") == "cli" and _unit("aligntax.cli.options") == "cli" and _unit("aligntax") == ""
    )
