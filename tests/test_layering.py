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


def test_the_checker_sees_imports():
    assert imported_packages(ROOT / "store" / "pool.py") == {"store"}
