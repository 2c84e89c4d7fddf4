"""vLLM servers are sized by blocks or bytes: the argv and environment carry no fraction of any memory; servers
sharing a machine are not pinned to one core."""

import argparse
import json

import pytest

from prefixpool.deploy.vllm_fleet import DEFAULT_SPIN_S, add_vllm_arguments, vllm_config
from prefixpool.deploy.vllm_server import DEFAULT_KV_BLOCKS, VllmConfig, argv, child_env, unpinned_threads
from prefixpool.deploy.vllm_sizing import KV_SPACE_ENV, KvSizeUnknown, block_bytes, kv_flags

# prefixpool.testing.tiny_llama's geometry: 2 layers, hidden 128, 4 heads, 2 KV heads (head_dim 32)
TINY = {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "torch_dtype": "float32"}
TINY_BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4  # layers x (K, V) x tokens x kv heads x head_dim x float32


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_argv_has_the_absolute_sizes_and_no_memory_fraction(model, monkeypatch):
    monkeypatch.setenv(KV_SPACE_ENV, "40")  # a legacy whole-GiB setting in our environment must not reach vLLM
    args = argv(VllmConfig(model, "tiny", num_blocks=160), 8000, "ipc://e", "ipc://r")
    assert "--gpu-memory-utilization" not in args and "--device-memory-utilization" not in args
    assert flag(args, "--num-gpu-blocks-override") == "160"
    assert flag(args, "--kv-cache-memory-bytes") == str(160 * TINY_BLOCK_BYTES) == "5242880"
    assert KV_SPACE_ENV not in child_env()


def test_the_same_config_gives_the_same_argv_on_any_machine(model):
    config = VllmConfig(model, "tiny", num_blocks=96, max_model_len=1024)
    assert argv(config, 1, "e", "r") == argv(config, 1, "e", "r")
    assert not any(value.replace(".", "", 1).isdigit() and "." in value for value in argv(config, 1, "e", "r"))


def test_up_passes_the_worker_niceness():
    parser = argparse.ArgumentParser()
    add_vllm_arguments(parser)
    args = ["--vllm", "2", "--model-path", "/models/tiny"]
    assert vllm_config(parser.parse_args(args)).worker_nice == 0
    assert vllm_config(parser.parse_args([*args, "--vllm-worker-nice", "19"])).worker_nice == 19


def test_up_bounds_vllms_spin_unless_told_vllm(model):
    parser = argparse.ArgumentParser()
    add_vllm_arguments(parser)
    args = ["--vllm", "2", "--model-path", model]
    bounded = vllm_config(parser.parse_args(args))
    assert bounded.spin_s == DEFAULT_SPIN_S and argv(bounded, 1, "e", "r")[2] == "prefixpool.vllm_connector.serve"
    assert vllm_config(parser.parse_args([*args, "--vllm-spin-s", "0.5"])).spin_s == 0.5
    plain = vllm_config(parser.parse_args([*args, "--vllm-spin-s", "vllm"]))
    assert plain.spin_s is None and argv(plain, 1, "e", "r")[2] == "vllm.entrypoints.openai.api_server"
    assert argv(bounded, 1, "e", "r")[3:] == argv(plain, 1, "e", "r")[3:]
    for bad in ("-1", "11", "fast"):
        with pytest.raises(SystemExit):
            parser.parse_args([*args, "--vllm-spin-s", bad])


def test_bytes_alone_let_vllm_fit_the_blocks(model):
    args = argv(VllmConfig(model, "tiny", num_blocks=None, kv_cache_bytes=3 << 30), 1, "e", "r")
    assert "--num-gpu-blocks-override" not in args
    assert flag(args, "--kv-cache-memory-bytes") == str(3 << 30)


def test_block_bytes_follow_the_model_and_dtype(tmp_path):
    llama_8b = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": llama_8b, "torch_dtype": "bfloat16"}))
    assert block_bytes(str(tmp_path), 16, "bfloat16") == 32 * 2 * 16 * 8 * 128 * 2  # 2 MiB: 128 KiB a token
    assert block_bytes(str(tmp_path), 16, "float32") == 2 * block_bytes(str(tmp_path), 16, "float16")
    mha = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 8, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(mha))
    assert block_bytes(str(tmp_path), 32, "auto") == 2 * 2 * 32 * 4 * 8 * 2  # no num_key_value_heads: MHA


def test_an_unreadable_model_asks_for_bytes(tmp_path):
    with pytest.raises(KvSizeUnknown, match="config.json"):
        kv_flags(str(tmp_path / "absent"), 32, "float32", num_blocks=64)
    assert kv_flags(str(tmp_path / "absent"), 32, "float32", kv_cache_bytes=1 << 30) == ["--kv-cache-memory-bytes",
                                                                                          str(1 << 30)]
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(KvSizeUnknown, match="num_hidden_layers"):
        block_bytes(str(tmp_path), 32, "float32")
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(KvSizeUnknown, match="dtype"):
        block_bytes(str(tmp_path), 32, "int3")


def test_a_config_must_be_sized_and_hold_one_full_request():
    with pytest.raises(ValueError, match="blocks"):
        VllmConfig("m", "m", num_blocks=None)
    with pytest.raises(ValueError, match="max_model_len"):
        VllmConfig("m", "m", num_blocks=64, max_model_len=2048)  # 63 usable blocks of 32: 2016 tokens
    assert VllmConfig("m", "m", num_blocks=65, max_model_len=2048).num_blocks == 65


@pytest.mark.parametrize("flags, num_blocks, kv_cache_bytes", [
    ([], DEFAULT_KV_BLOCKS, None),
    (["--vllm-kv-blocks", "300"], 300, None),
    (["--vllm-kv-gib", "1.5"], None, 3 << 29),
    (["--vllm-kv-blocks", "300", "--vllm-kv-gib", "2"], 300, 2 << 30),
])
def test_up_vllm_flags_size_by_blocks_or_gib(flags, num_blocks, kv_cache_bytes):
    parser = argparse.ArgumentParser()
    add_vllm_arguments(parser)  # `prefixpool up --vllm` and `prefixpool ray up --vllm`
    config = vllm_config(parser.parse_args(["--vllm", "2", "--model-path", "/models/tiny", *flags]))
    assert (config.num_blocks, config.kv_cache_bytes) == (num_blocks, kv_cache_bytes)


def test_servers_sharing_a_machine_run_unpinned_one_thread_each_unless_the_operator_says_otherwise():
    assert unpinned_threads({}) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    assert unpinned_threads({"OMP_NUM_THREADS": "4"}) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "4"}
    assert unpinned_threads({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}) == {}  # pinning chosen: left alone
