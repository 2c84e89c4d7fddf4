"""A vLLM server that fails to start is reported with the engine core's own error, not only the log's tail.

The log ends with the API server's traceback ("Engine core initialization failed. See root cause above"):
the root cause is in the engine core's ERROR lines, which a fixed-size tail cut off in CI.
"""

from prefixpool.deploy.vllm_server import failure_summary

CORE = "(EngineCore pid=7) ERROR 12-06 23:26:00 [core.py:1510] "


def test_the_engine_cores_error_lines_come_before_the_tail():
    cause = f"{CORE}RuntimeError: Worker failed with error 'UNAVAILABLE: etcd'"
    log = "\n".join([f"{CORE}EngineCore failed to start.", cause, *(["noise " * 20] * 200),
                     "RuntimeError: Engine core initialization failed. See root cause above."])
    summary = failure_summary(log, tail_chars=200)
    assert cause in summary
    assert summary.index(cause) < summary.index("log tail:")
    assert summary.endswith("See root cause above.")


def test_a_long_traceback_keeps_its_start_and_its_end():
    lines = [f"{CORE}line {i}" for i in range(500)]
    summary = failure_summary("\n".join(lines), first=3, last=2)
    kept = summary.split("log tail:")[0]
    assert [f"line {i}" in kept for i in (0, 2, 3, 497, 498, 499)] == [True, True, False, False, True, True]
    assert "[495 ERROR lines left out]" in kept


def test_a_log_without_error_lines_says_so():
    assert failure_summary("killed\n").startswith("no ERROR line; log tail:\nkilled")
