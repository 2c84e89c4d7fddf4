"""Run prefixpool as on a machine that never built the C chain loop (no compiler, no libxxhash-dev).

    directory = write_refusal(Path("/tmp/no-c-chain"))   # a sitecustomize.py that refuses prefixpool.store._chain
    env = refusing_env(directory)                        # PYTHONPATH with it first
    subprocess.run([...], env=env)                       # that process and every Python child it starts

    python -m prefixpool.testing.refuse_c_chain DIR      # writes DIR, prints the PYTHONPATH to run under:
    PYTHONPATH=$(python -m prefixpool.testing.refuse_c_chain DIR) prefixpool demo

Python imports `sitecustomize` at start from the first directory on its path that has one; the file
written here puts a finder first on `sys.meta_path` that raises ImportError for the compiled module,
so `prefixpool.store.keys` takes its pure-Python loop, then runs any sitecustomize it shadows.
Children inherit PYTHONPATH, so the refusal reaches workers and routers a launcher spawns.
`loaded_c_chain(pid)` reads /proc/PID/maps: whether a live process has the extension mapped.
Knows nothing of clusters or of what the chain loop computes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REFUSED = "prefixpool.store._chain"
EXTENSION_STEM = "_chain.cpython-"  # the start of the compiled file's name, as /proc/PID/maps lists it

SITECUSTOMIZE = f'''"""Written by prefixpool.testing.refuse_c_chain: this process runs without {REFUSED}."""
import importlib.machinery
import os
import sys


class RefuseCChain:
    def find_spec(self, name, path=None, target=None):
        if name == {REFUSED!r}:
            raise ModuleNotFoundError("refused by prefixpool.testing.refuse_c_chain", name=name)
        return None


sys.meta_path.insert(0, RefuseCChain())
_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_shadowed = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _shadowed is not None and _shadowed.origin:  # the sitecustomize this one hides still runs
    with open(_shadowed.origin) as _file:
        exec(compile(_file.read(), _shadowed.origin, "exec"), {{"__name__": "sitecustomize"}})
'''


def write_refusal(directory: Path) -> Path:
    """`directory` with a sitecustomize.py that refuses the compiled chain loop; returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory


def refusing_pythonpath(directory: Path, pythonpath: str | None = None) -> str:
    """PYTHONPATH with `directory` first (`pythonpath`: what follows it; default this process's)."""
    rest = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    return os.pathsep.join([str(directory), *filter(None, rest.split(os.pathsep))])


def refusing_env(directory: Path) -> dict[str, str]:
    """This process's environment with the refusal first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": refusing_pythonpath(directory)}


def loaded_c_chain(pid: int) -> bool:
    """Whether process `pid` has the compiled chain loop mapped (Linux's /proc/PID/maps)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return any(EXTENSION_STEM in line and "/store/" in line for line in maps.splitlines())


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m prefixpool.testing.refuse_c_chain DIR", file=sys.stderr)
        return 2
    print(refusing_pythonpath(write_refusal(Path(argv[0]).resolve())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
