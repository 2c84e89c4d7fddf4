"""The console script: every subcommand listed, only the chosen one imported."""

import subprocess
import sys

from prefixpool.deploy.cli import COMMANDS, selected_command

PROBE = """
import sys
from prefixpool.deploy.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
heavy = sorted(m for m in ("torch", "aiohttp", "aetcd", "ray") if m in sys.modules)
print("HEAVY", ",".join(heavy) or "-")
sys.exit(code)
"""


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)


def test_help_lists_every_command_and_imports_nothing_heavy():
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    assert all(name in done.stdout for name in COMMANDS)
    assert "HEAVY -" in done.stdout


def test_version_imports_no_torch():
    done = run_cli("version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("prefixpool ") and "hash scheme v" in done.stdout
    assert "HEAVY -" in done.stdout


def test_a_subcommand_gets_its_own_flags():
    done = run_cli("worker", "--help")
    assert done.returncode == 0, done.stderr
    assert "--num-blocks" in done.stdout


def test_contradicting_settings_stop_with_one_line_not_a_traceback():
    done = run_cli("worker", "--etcd-endpoints", "127.0.0.1:1", "--etcd-shards", "127.0.0.1:2;127.0.0.1:3")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "prefixpool worker: error: --etcd-endpoints 127.0.0.1:1 is not shard 0 of --etcd-shards" in done.stderr


def test_the_selected_command_is_the_first_command_word():
    assert selected_command(["--verbose", "router", "--port", "9"]) == "router"
    assert selected_command(["--help"]) is None


ROUTER_STARTUP = """
import sys
from prefixpool.deploy import router_cli, router_processes
config = router_cli.model_config("served", sys.argv[1])
tokenizer = router_cli.tokenizer_for(sys.argv[1])
namespace = router_cli.cache_namespace(config, "bfloat16", 16)
print("READ", config.name, config.num_layers, config.kv_bytes_per_token("bfloat16"), namespace.dtype,
      len(tokenizer.encode("hi")))
print("TORCH", "torch" in sys.modules)
"""


def test_the_router_reads_a_checkpoint_directory_without_torch(tmp_path):
    """Router processes (and each `--processes` child) start without torch: its import is seconds and hundreds of MB."""
    import json

    from prefixpool.model.config import preset

    (tmp_path / "config.json").write_text(json.dumps(preset("llama-3-8b").to_hf()))
    done = subprocess.run([sys.executable, "-c", ROUTER_STARTUP, str(tmp_path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "READ served 32 131072 bfloat16 " in done.stdout
    assert "TORCH False" in done.stdout
