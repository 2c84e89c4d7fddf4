"""The `prefixpool` console script: one subcommand per user-facing entry point.

Each subcommand lives in its own module and exposes `add_arguments(parser)`
and `run(args) -> int`; this file only maps names to modules, so importing the
CLI stays cheap (a subcommand's heavy imports happen when it runs).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from prefixpool.deploy.settings import SettingsError

# name -> (module defining add_arguments and run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "version": ("prefixpool.deploy.version", "print the version and the hash scheme"),
    "etcd": ("prefixpool.deploy.etcd_server", "run a local etcd on free loopback ports with a temp data dir"),
    "router": ("prefixpool.deploy.router_cli", "run the cache-aware router (OpenAI-compatible HTTP API)"),
    "worker": ("prefixpool.deploy.worker_cli", "run one worker: engine, block pool, transfer server, etcd lease"),
    "vllm-node": ("prefixpool.deploy.vllm_node_cli",
                  "run the sidecar that registers one vLLM server and learns its cache from KV events"),
    "demo": ("prefixpool.deploy.demo", "run `up` and a shared-prefix workload; print what the cache saved"),
    "up": ("prefixpool.deploy.launcher", "start etcd, N workers and a router on 127.0.0.1; Ctrl-C stops all"),
    "ray": ("prefixpool.deploy.ray_cli", "deploy on an existing Ray cluster (up) or remove the deployment (down)"),
    "replay": ("prefixpool.replay.command", "replay a Mooncake-format trace, simulated or against a live router"),
    "pin": ("prefixpool.deploy.pin_cli", "pin (or unpin) a prefix on the workers through the router, for a TTL"),
}


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand is listed; only `selected` is imported (so `--help` and `version` stay cheap)."""
    parser = argparse.ArgumentParser(prog="prefixpool", description="A distributed prefix-cache pool for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == selected:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(run=module.run)
    return parser


def selected_command(argv: list[str]) -> str | None:
    """The subcommand named on the command line (the first word that is one), if any."""
    return next((word for word in argv if word in COMMANDS), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(selected_command(argv))
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except SettingsError as error:  # contradicting flags/env: one line, as argparse reports a bad flag
        parser.exit(2, f"prefixpool {args.command}: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
