"""vLLM's OpenAI server, with how long its processes spin after a message bounded.

    <vLLM's python> -m prefixpool.vllm_connector.serve <vllm api_server args>    # PREFIXPOOL_VLLM_SPIN_S=0.02

vLLM 0.32 passes each step between its engine core and its model worker through shared-memory
queues whose readers, after every message, spin on sched_yield for one second before they sleep on
a socket (`SpinCondition`, busy_loop_s=1, no setting). On a GPU node that costs a spare CPU core per
process. Where several CPU servers share a machine it costs the machine: a server that gets a
request every second keeps its worker and engine core spinning, and two such servers fill two cores
(measured: benchmarks/gateway.md). With PREFIXPOOL_VLLM_SPIN_S set, this module lowers that second
to the value given and has idle readers recheck their queue every RECHECK_MS, in this process and in
every process vLLM starts from it (a forked child shares the change; a spawned one imports this module
again as its main module), then runs vLLM's server. Without the variable it changes nothing.
`prefixpool up --vllm` sets it (`--vllm-spin-s`, default 0.02; `vllm` leaves vLLM as it is).
"""

from __future__ import annotations

import os
import runpy

SPIN_ENV = "PREFIXPOOL_VLLM_SPIN_S"
RECHECK_MS = 5  # an idle reader's wake-ups to look at its queue (vLLM: 5,000)


def bound_spin(seconds: float) -> None:
    """Make `seconds` the busy-loop time of every SpinCondition created from now on, and idle readers recheck
    their queue every RECHECK_MS."""
    from vllm.distributed.device_communicators import shm_broadcast

    init = shm_broadcast.SpinCondition.__init__
    names = init.__code__.co_varnames[1:init.__code__.co_argcount]
    if "busy_loop_s" not in names or init.__defaults__ is None:
        raise RuntimeError(f"{SPIN_ENV}: this vLLM's SpinCondition takes no busy_loop_s default ({names})")
    defaults = dict(zip(names[-len(init.__defaults__):], init.__defaults__))
    defaults["busy_loop_s"] = seconds
    init.__defaults__ = tuple(defaults.values())
    # An idle reader sleeps on the writer's ZMQ notification, which does not always wake it; it then finds
    # the message at its next recheck: vLLM's 5 s, rare behind a 1 s spin, every few requests behind a short
    # one (measured, spin 2 ms alone: TTFT p99 4.7 s). Rechecking every RECHECK_MS bounds that wait.
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS


def spin_from_env() -> float | None:
    value = os.environ.get(SPIN_ENV)
    if not value:
        return None
    seconds = float(value)
    if not 0 <= seconds <= 10:
        raise ValueError(f"{SPIN_ENV}={value}: seconds from 0 to 10")
    return seconds


# as vLLM's main module only (a spawned child imports it as __mp_main__); imported elsewhere it does nothing
if __name__ in ("__main__", "__mp_main__") and (_spin := spin_from_env()) is not None:
    bound_spin(_spin)

if __name__ == "__main__":
    # alter_sys=False keeps this module as __main__, so a spawned child re-imports it (and bounds the spin)
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=False)
