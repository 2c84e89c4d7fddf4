"""vLLM's /metrics text to a load, and the loop that puts a load into a node's record when it changes."""

import asyncio

from prefixpool.meta.load_report import Load, report_load
from prefixpool.vllm_sidecar.metrics import parse_load, parse_num_blocks

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-vllm"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny-vllm"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-vllm"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny-vllm",reason="capacity"} 7.0
"""


def test_running_and_waiting_are_summed_over_engines_and_nothing_else_counts():
    assert parse_load(METRICS) == Load(num_queued=2, num_running=4)


def test_missing_or_garbled_gauges_are_no_load_rather_than_zero():
    assert parse_load("") is None
    assert parse_load("vllm:num_requests_running 1.0\n") is None  # waiting missing
    assert parse_load("vllm:num_requests_running oops\nvllm:num_requests_waiting 0\n") is None


class Sink:  # stands in for Membership.update_load: what would be put
    def __init__(self) -> None:
        self.puts: list[tuple[int, int, float]] = []

    def update_load(self, num_queued: int, num_running: int, prefill_tokens_per_s: float) -> None:
        self.puts.append((num_queued, num_running, prefill_tokens_per_s))


def test_a_load_is_put_when_it_changes_and_a_failed_sample_puts_nothing():
    samples = [Load(0, 1), Load(0, 1), None, Load(2, 1), Load(2, 1), Load(0, 0)]
    sink = Sink()

    async def run() -> None:
        done = asyncio.Event()

        async def sample():
            if not samples:
                done.set()
                await asyncio.sleep(3600)
            return samples.pop(0)

        task = asyncio.create_task(report_load(sample, sink, period_s=0.0, refresh_s=1e9))
        await asyncio.wait_for(done.wait(), 30)
        task.cancel()

    asyncio.run(run())
    assert sink.puts == [(0, 1, 0.0), (2, 1, 0.0), (0, 0, 0.0)]


def test_the_cache_size_is_vllms_allocated_blocks_less_its_null_block():
    info = ('vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
            'num_gpu_blocks="150",num_gpu_blocks_override="150",prefix_caching_hash_algo="sha256"} 1.0\n')
    assert parse_num_blocks(METRICS + info) == 149
    assert parse_num_blocks(METRICS) is None, "a vLLM that does not say its size: the router prices no eviction"
