"""The dependency direction of DESIGN.md, checked by parsing every import."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("store", "transfer", "router", "cluster")
ALLOWED = {
    "store": set(),
    "transfer": {"store"},
    "router": {"store", "transfer"},
    "cluster": {"store", "transfer", "router"},
}


# cluster's wings: which other wings each may import (deploy sits on top of them all).
WINGS = ("engine", "meta", "node", "replay", "vllm", "deploy")
WING_ALLOWED = {
    "engine": set(),
    "meta": set(),
    "node": {"engine", "meta"},
    "replay": set(),
    "vllm": {"meta"},  # a vLLM node is registered and published like ours, through meta; no engine, no node
    "deploy": {"engine", "meta", "node", "replay", "vllm"},
}
# what of router/ a wing may use: the engine and a node only the contracts they implement.
ROUTER_ALLOWED = {
    "engine": {"router.contract"},
    "node": {"router.contract"},
    "vllm": set(),  # the sidecar speaks vLLM's and etcd's formats, none of the router's
}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(PACKAGES)


def test_packages_import_only_downward():
    violations = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in imported_packages(path) - ALLOWED[package] - {package}:
                violations.append(f"{path.relative_to(ROOT)} imports {target}")
    assert violations == []


def wing_violations(wing: str, path: Path) -> list[str]:
    found = []
    for module in imported_modules(path):
        parts = module.split(".")
        if parts[0] == "cluster" and len(parts) > 1 and parts[1] != wing and parts[1] not in WING_ALLOWED[wing]:
            found.append(f"{path.name} imports {module}")
        if parts[0] == "router" and wing in ROUTER_ALLOWED:
            if not any(module.startswith(allowed) for allowed in ROUTER_ALLOWED[wing]):
                found.append(f"{path.name} imports {module}")
    return found


def test_cluster_is_only_wings():
    loose = sorted(p.name for p in (ROOT / "cluster").glob("*.py") if p.name != "__init__.py")
    assert loose == []
    assert {p.parent.name for p in (ROOT / "cluster").glob("*/__init__.py")} == set(WINGS)


def test_wings_import_only_what_they_may():
    violations = []
    for wing in WINGS:
        for path in sorted((ROOT / "cluster" / wing).rglob("*.py")):
            violations += wing_violations(wing, path)
    assert violations == []


def test_wing_graph_has_no_cycles():
    import graphlib

    graphlib.TopologicalSorter(WING_ALLOWED).prepare()  # raises CycleError on a cycle


def test_the_wing_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from cluster.deploy.settings import setting\nfrom router.service import Router\n")
    assert sorted(wing_violations("engine", bad)) == [
        "bad.py imports cluster.deploy.settings",
        "bad.py imports router.service",
    ]
    assert wing_violations("deploy", bad) == []


def test_the_checker_sees_imports():
    assert imported_packages(ROOT / "store" / "pool.py") == {"store"}
