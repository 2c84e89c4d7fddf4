"""`prefixpool version`: the installed version and the block-key scheme it speaks."""

from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

from prefixpool.store.keys import HASH_SCHEME_VERSION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    del args
    print(f"prefixpool {installed_version()} (hash scheme v{HASH_SCHEME_VERSION})")
    return 0


def installed_version() -> str:
    try:
        return version("prefixpool")
    except PackageNotFoundError:  # run from a source tree on PYTHONPATH, not pip-installed (scripts/gpu_check.sh)
        return "(source tree, not installed)"
