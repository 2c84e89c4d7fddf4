"""`prefixpool version`: the installed version and the block-key scheme it speaks."""

from __future__ import annotations

import argparse
from importlib.metadata import version

from prefixpool.store.keys import HASH_SCHEME_VERSION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser


def run(args: argparse.Namespace) -> int:
    del args
    print(f"prefixpool {version('prefixpool')} (hash scheme v{HASH_SCHEME_VERSION})")
    return 0
