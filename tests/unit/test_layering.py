"""The import direction of the package's wings, checked by parsing every import, transitively.

Each wing may import only the wings listed for it (below it); on top of that, what a wing pulls in
through its whole import closure is checked against what must never load in its process: the
vLLM connector runs inside vLLM and must not drag in the router, aiohttp's server or Ray.
"""

from __future__ import annotations

import ast
import graphlib
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "prefixpool"

# wing -> the wings it may import directly. Order matters only for reading: bottom first.
ALLOWED = {
    "store": set(),
    "net": set(),
    "transfer": {"store"},
    "meta": {"store", "net"},
    "contract": {"store"},
    "model": {"store"},
    "node": {"store", "transfer", "meta"},
    "engine": {"store", "contract", "model"},
    "router": {"store", "meta", "contract", "model", "net"},
    "worker": {"store", "transfer", "meta", "contract", "model", "engine", "node"},
    "vllm_sidecar": {"store", "meta"},
    "vllm_connector": {"store", "transfer", "meta", "node"},
    "replay": {"store", "meta", "router"},
    "deploy": {"store", "net", "transfer", "meta", "contract", "model", "node", "engine", "router", "worker",
               "vllm_sidecar", "vllm_connector", "replay"},
    "testing": {"store", "net", "transfer", "meta", "contract", "model", "node", "engine", "router", "worker",
                "vllm_sidecar", "vllm_connector", "replay", "deploy"},
}
# modules that must not load, through any chain of imports, in a wing's process
NEVER = {
    "store": {"aiohttp", "aetcd", "ray", "prefixpool.router"},
    "net": {"aiohttp", "aetcd", "ray", "torch", "numpy", "prefixpool.router", "prefixpool.meta"},
    "meta": {"prefixpool.router", "prefixpool.engine", "torch", "ray"},
    "model": {"torch", "aiohttp", "ray"},
    "node": {"prefixpool.router", "aiohttp.web", "ray", "prefixpool.engine"},
    "vllm_connector": {"prefixpool.router", "aiohttp.web", "aiohttp", "ray", "prefixpool.engine",
                       "prefixpool.worker", "prefixpool.deploy"},
    "vllm_sidecar": {"prefixpool.router", "prefixpool.engine", "ray"},
    "router": {"torch", "ray", "prefixpool.engine", "prefixpool.worker"},
}


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "prefixpool" and len(parts) > 1 else None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def runtime_nodes(tree: ast.AST):
    """Every node of the tree but those under `if TYPE_CHECKING:` (never run)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (n for branch in child.orelse for n in ast.walk(branch))
            continue
        yield child
        yield from runtime_nodes(child)


def imports_of(path: Path) -> set[str]:
    """Every module an import statement in `path` names, at module level or inside functions."""
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names
                      if module_path(f"{node.module}.{alias.name}")}
    return found


def with_parents(module: str) -> set[str]:
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


@cache
def closure(module: str) -> frozenset[str]:
    """Every module importing `module` loads, ours and others' (importing a.b.c runs a and a.b too)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        current = todo.pop()
        for name in with_parents(current) - seen:
            seen.add(name)
            path = module_path(name)
            if path is not None:
                todo += sorted(imports_of(path) - seen)
    return frozenset(seen)


def wing_modules(wing: str) -> list[str]:
    return [module_name(p) for p in sorted((PACKAGE / wing).rglob("*.py"))]


def direct_violations(wing: str, path: Path) -> list[str]:
    found = []
    for module in sorted(imports_of(path)):
        target = wing_of(module)
        if target is not None and target != wing and target not in ALLOWED[wing]:
            found.append(f"{path.name} imports {module}")
    return found


def test_the_package_is_only_wings():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == []
    assert {p.parent.name for p in PACKAGE.glob("*/__init__.py")} == set(ALLOWED)


def test_wings_import_only_what_they_may():
    violations = []
    for wing in ALLOWED:
        for path in sorted((PACKAGE / wing).rglob("*.py")):
            violations += direct_violations(wing, path)
    assert violations == []


def test_no_wing_loads_what_its_process_must_not_through_any_chain():
    violations = []
    for wing, forbidden in NEVER.items():
        for module in wing_modules(wing):
            loaded = closure(module)
            violations += [f"{module} loads {bad}" for bad in sorted(forbidden) if bad in loaded]
    assert violations == []


def test_wing_graph_has_no_cycles():
    graphlib.TopologicalSorter(ALLOWED).prepare()  # raises CycleError on a cycle


def test_nothing_outside_testing_imports_deploy_or_testing():
    for wing in set(ALLOWED) - {"deploy", "testing"}:
        assert not ALLOWED[wing] & {"deploy", "testing"}, wing
    assert "testing" not in ALLOWED["deploy"]


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from prefixpool.deploy.settings import setting\nfrom prefixpool.router.service import Router\n")
    assert direct_violations("engine", bad) == ["bad.py imports prefixpool.deploy.settings",
                                                "bad.py imports prefixpool.router.service"]
    assert direct_violations("deploy", bad) == []


def test_the_closure_follows_chains():
    """meta.mirror reaches store.keys only through meta.layout et al.: the closure must see it."""
    loaded = closure("prefixpool.meta.mirror")
    assert "prefixpool.store.keys" in loaded and "prefixpool.meta.index" in loaded
    assert "prefixpool.router" not in loaded
    assert "torch" in closure("prefixpool.engine.model")
