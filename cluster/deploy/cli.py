"""The `prefixpool` console script: one subcommand per user-facing entry point.

Each subcommand lives in its own module and exposes `add_arguments(parser)`
and `run(args) -> int`; this file only maps names to modules, so importing the
CLI stays cheap (a subcommand's heavy imports happen when it runs).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module defining add_arguments and run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "version": ("cluster.deploy.version", "print the version and the hash scheme"),
    "etcd": ("cluster.deploy.etcd_server", "run a local etcd on free loopback ports with a temp data dir"),
    "router": ("cluster.deploy.router_cli", "run the cache-aware router (OpenAI-compatible HTTP API)"),
    "worker": ("cluster.deploy.worker_cli", "run one worker: engine, block pool, transfer server, etcd lease"),
    "vllm-node": ("cluster.deploy.vllm_node_cli", "run the sidecar that registers one vLLM server and learns its cache from KV events"),
    "demo": ("cluster.deploy.demo", "run `up` and a shared-prefix workload; print what the cache saved"),
    "up": ("cluster.deploy.launcher", "start etcd, N workers and a router on 127.0.0.1; Ctrl-C stops all"),
    "ray": ("cluster.deploy.ray_cli", "deploy on an existing Ray cluster (up) or remove the deployment (down)"),
    "replay": ("cluster.replay.command", "replay a Mooncake-format trace, simulated or against a live router"),
    "pin": ("cluster.deploy.pin_cli", "pin (or unpin) a prefix on the workers through the router, for a TTL"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixpool", description="A distributed prefix-cache pool for LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
