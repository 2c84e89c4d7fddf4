"""The distribution installs exactly one top-level package, `prefixpool`, with its console script.

Users put prefixpool into vLLM images beside other software: a generic top-level name (`router`,
`store`) would collide. Builds a real wheel from the working tree and reads what it would install.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, text=True, timeout=600)
    (wheel,) = out.glob("prefixpool-*.whl")
    return wheel


def test_the_wheel_holds_one_top_level_package_and_the_cli(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = archive.read(f"{dist_info}/entry_points.txt").decode()
    tops = {name.split("/")[0] for name in names}
    assert tops == {"prefixpool", dist_info}
    assert "prefixpool = prefixpool.deploy.cli:main" in entry_points
    wings = {n.split("/")[1] for n in names if n.startswith("prefixpool/") and n.endswith("/__init__.py")}
    assert {"store", "transfer", "meta", "router", "worker", "vllm_connector", "deploy"} <= wings
    assert "prefixpool/vllm_connector/connector.py" in names


def test_the_wheel_installs_and_imports_from_outside_the_tree(tmp_path):
    """Installed without its dependencies into a target dir, the connector imports from there, not the tree."""
    wheel = build_wheel(tmp_path / "wheel")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == [
        "prefixpool"]
    probe = "import prefixpool.vllm_connector.config as c, prefixpool.store.keys as k; print(c.__file__, k.__file__)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         check=True, capture_output=True, text=True, timeout=120).stdout
    assert all(path.startswith(str(target)) for path in out.split())
