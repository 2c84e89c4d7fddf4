"""`prefixpool up --vllm N --lora-modules NAME=DIR ... --lora-nodes K`: which vLLM servers load which adapters.

The flags reach vLLM as its own (`--enable-lora --lora-modules NAME=DIR --max-lora-rank R --max-loras N`);
with --lora-nodes K only vllm-0 .. vllm-(K-1) get them. Malformed specs stop `up` before anything starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pytest

from prefixpool.deploy.launcher import LocalCluster
from prefixpool.deploy.launcher import add_arguments as add_up_arguments
from prefixpool.deploy.vllm_fleet import vllm_config
from prefixpool.deploy.vllm_server import lora_flags


@dataclass
class Etcd:  # what LocalCluster reads of its etcd before it starts servers
    endpoint: str = "127.0.0.1:2379"


def adapter(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    return path


def up_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return parser.parse_args(["--vllm", "2", "--model-path", "/m", *flags])


def test_lora_modules_become_vllms_own_flags(tmp_path):
    sql, chat = adapter(tmp_path, "sql"), adapter(tmp_path, "chat")
    config = vllm_config(up_args("--lora-modules", f"sql={sql}", f"chat={chat}", "--max-lora-rank", "8"))
    assert config.lora_modules == (("sql", str(sql.resolve())), ("chat", str(chat.resolve())))
    assert lora_flags(config) == ["--enable-lora", "--lora-modules", f"sql={sql.resolve()}", f"chat={chat.resolve()}",
                                  "--max-lora-rank", "8", "--max-loras", "2"]
    assert lora_flags(vllm_config(up_args())) == []  # no adapters: LoRA stays off


@pytest.mark.parametrize("spec, message", [("sql", "NAME=DIR"), ("=x", "NAME=DIR"), ("sql=/nowhere", "adapter_config"),
                                           ("twice", "twice")])
def test_malformed_lora_modules_stop_up(tmp_path, spec, message):
    sql = adapter(tmp_path, "sql")
    specs = [f"sql={sql}", f"sql={sql}"] if spec == "twice" else [spec]
    with pytest.raises(SystemExit, match=message):
        vllm_config(up_args("--lora-modules", *specs))


def test_lora_nodes_loads_the_adapters_on_the_first_servers_only(tmp_path):
    args = up_args("--lora-modules", f"sql={adapter(tmp_path, 'sql')}", "--lora-nodes", "1")
    cluster = LocalCluster(num_workers=0, vllm=vllm_config(args), num_vllm=2, lora_nodes=args.lora_nodes,
                           etcd=Etcd())
    assert [name for name, _ in cluster.vllm_config_for("vllm-0").lora_modules] == ["sql"]
    assert cluster.vllm_config_for("vllm-1").lora_modules == ()
    every = LocalCluster(num_workers=0, vllm=vllm_config(args), num_vllm=2, etcd=Etcd())
    assert all(every.vllm_config_for(n).lora_modules for n in ("vllm-0", "vllm-1"))
