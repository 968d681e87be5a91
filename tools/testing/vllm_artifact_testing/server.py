"""Start and stop a real ``vllm serve`` process on 127.0.0.1 for tests and the demo."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import requests

from vllm_artifact_testing.engine_env import apply_cpu_engine_env, engine_cli_args


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningServer:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


def vllm_command() -> list[str]:
    """The ``vllm`` console script of the running interpreter's environment."""
    script = Path(sys.executable).with_name("vllm")
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli"]


@contextlib.contextmanager
def vllm_server(
    model: str | Path,
    extra_args: Sequence[str] = (),
    *,
    startup_timeout: float = 600.0,
    log_dir: Path | None = None,
) -> Iterator[RunningServer]:
    """Run ``vllm serve MODEL`` with the CPU test settings until the block exits."""
    specs = [(model, extra_args)]
    with vllm_servers(specs, startup_timeout=startup_timeout, log_dir=log_dir) as servers:
        yield servers[0]


@contextlib.contextmanager
def vllm_servers(
    specs: Sequence[tuple[str | Path, Sequence[str]]],
    *,
    startup_timeout: float = 600.0,
    log_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[list[RunningServer]]:
    """Run one ``vllm serve`` per ``(model, extra_args)`` until the block exits, with ``env``
    added to their environment. All are started before any is waited for: a start-up is
    mostly one process importing at a time, so their start-ups overlap (two on 2 cores: 68 s,
    against 47 + 51 s one after the other)."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="vllm-serve-"))
    servers: list[RunningServer] = []
    ports: set[int] = set()

    def start(model: str | Path, extra_args: Sequence[str]) -> RunningServer:
        port = free_port()
        while port in ports:  # none has bound its port yet: never hand one out twice
            port = free_port()
        ports.add(port)
        return _start(model, extra_args, log_dir, port, env or {})

    try:
        for model, extra_args in specs:
            servers.append(start(model, extra_args))
        for i, (model, extra_args) in enumerate(specs):
            # A free port is only free until someone binds it: another process (or a server
            # started here, for its engine's ZMQ sockets) may take it before this server
            # does, which it reports as EADDRINUSE at start-up. Then start it on another.
            for attempt in range(1, _START_ATTEMPTS + 1):
                try:
                    _wait_ready(servers[i], startup_timeout)
                    break
                except _PortTaken:
                    if attempt == _START_ATTEMPTS:
                        raise
                    _stop(servers[i].process)
                    servers[i] = start(model, extra_args)
        yield servers
    finally:
        for server in servers:
            _stop(server.process)


def _start(
    model: str | Path,
    extra_args: Sequence[str],
    log_dir: Path,
    port: int,
    extra_env: Mapping[str, str],
) -> RunningServer:
    env = apply_cpu_engine_env({**os.environ, **extra_env})
    log_path = log_dir / f"vllm-serve-{port}.log"
    cmd = [
        *vllm_command(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *engine_cli_args(),
        *extra_args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return RunningServer(f"http://127.0.0.1:{port}", process, log_path)


_START_ATTEMPTS = 3
#: How ``vllm serve`` reports that its HTTP port was taken (``OSError`` errno 98).
_PORT_TAKEN_MESSAGE = "Address already in use"


class _PortTaken(RuntimeError):
    """The server exited at start-up because its port was bound by someone else."""


def _wait_ready(server: RunningServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log_tail()
            error = _PortTaken if _PORT_TAKEN_MESSAGE in tail else RuntimeError
            raise error(
                f"vllm serve exited with code {server.process.returncode} before it was ready; "
                f"log tail:\n{tail}"
            )
        with contextlib.suppress(requests.RequestException):
            if requests.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(1.0)
    raise TimeoutError(
        f"vllm serve not ready after {timeout:.0f} s; log tail:\n{server.log_tail()}"
    )


def _stop(process: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGINT (vLLM's clean shutdown), then SIGKILL the whole process group if it lingers."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
