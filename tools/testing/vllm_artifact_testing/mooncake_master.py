"""Run a real ``mooncake_master`` on loopback for tests: start, wait until it serves, kill,
restart on the same ports, stop.

The master of ``mooncake-transfer-engine`` listens on three ports: RPC (clients' master
address), the embedded HTTP metadata server (the transfer engine's metadata URL) and the
metrics/admin server. All three are picked free on 127.0.0.1, so parallel test sessions
never share a master; a restart reuses them, because clients keep the addresses they were
set up with.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["MooncakeMaster", "client_env", "master_binary", "mooncake_master", "port_accepts"]

_HOST = "127.0.0.1"


def master_binary() -> str:
    """The ``mooncake_master`` next to the running interpreter (the venv's bin dir)."""
    script = Path(sys.executable).with_name("mooncake_master")
    if not script.exists():
        raise FileNotFoundError(
            f"{script} is missing; install the Mooncake extra (pip install vllm-artifact[mooncake])"
        )
    return str(script)


def port_accepts(port: int, timeout: float = 0.2) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:``port``."""
    try:
        with socket.create_connection((_HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (held open together, so the
    kernel cannot hand out one twice)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((_HOST, 0))
            socks.append(sock)
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class MooncakeMaster:
    """One master process on fixed loopback ports (see :func:`mooncake_master`)."""

    def __init__(self, extra_args: Sequence[str] = (), *, log_dir: Path | None = None) -> None:
        self.rpc_port, self.http_port, self.metrics_port = _free_ports(3)
        self.extra_args = list(extra_args)
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="mooncake-master-")) / "master.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def master_address(self) -> str:
        """``host:port`` of the RPC server (a client's ``master_server_addr``)."""
        return f"{_HOST}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """URL of the embedded HTTP metadata server (a client's ``metadata_server``)."""
        return f"http://{_HOST}:{self.http_port}/metadata"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        return [
            master_binary(),
            f"--rpc_port={self.rpc_port}",
            f"--rpc_address={_HOST}",
            f"--metrics_host={_HOST}",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={_HOST}",
            f"--http_metadata_server_port={self.http_port}",
            *self.extra_args,
        ]

    def start(self, timeout: float = 20.0) -> None:
        """Start the master and wait (at most ``timeout`` s) until its RPC and metadata ports
        accept connections. A port still held by the previous process (its sockets linger
        for a moment after a kill) makes the master exit at once: it is started again."""
        if self.alive:
            raise RuntimeError("the mooncake master is already running")
        deadline = time.monotonic() + timeout
        while True:
            self.starts += 1
            with self.log_path.open("ab") as log:
                log.write(f"\n==== start {self.starts}: {' '.join(self.command())}\n".encode())
                log.flush()
                self.process = subprocess.Popen(
                    self.command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # a ^C of the test run does not reach it first
                )
            while time.monotonic() < deadline and self.alive:
                if port_accepts(self.rpc_port) and port_accepts(self.http_port):
                    return
                time.sleep(0.05)
            if self.alive or time.monotonic() >= deadline:
                self.kill()
                raise TimeoutError(
                    f"mooncake_master did not serve within {timeout:.0f} s; log tail:\n"
                    + self.log_tail()
                )
            time.sleep(0.2)  # it exited (a port still in use): try again

    def kill(self) -> None:
        """SIGKILL the master (a crash: every object it knew of is lost)."""
        process = self.process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout=10)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()

    def restart(self, *, crash: bool = True, timeout: float = 20.0) -> None:
        """Kill (``crash``) or stop the master, then start a fresh one on the same ports."""
        if crash:
            self.kill()
        else:
            self.stop()
        self.start(timeout=timeout)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_bytes().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def mooncake_master(
    extra_args: Sequence[str] = (), *, timeout: float = 20.0, log_dir: Path | None = None
) -> Iterator[MooncakeMaster]:
    """A running master on free loopback ports for the block, stopped afterwards.

    ``extra_args`` go to ``mooncake_master`` as they are (e.g. ``--client_ttl=2``).
    """
    master = MooncakeMaster(extra_args, log_dir=log_dir)
    master.start(timeout=timeout)
    try:
        yield master
    finally:
        master.stop()


def client_env() -> dict[str, str]:
    """Environment a Mooncake client process on this host needs to be reachable on loopback
    (without it the transfer engine advertises the host's first non-loopback address)."""
    return {**os.environ, "MC_TCP_BIND_ADDRESS": _HOST}


@contextlib.contextmanager
def mooncake_store_node(
    master: MooncakeMaster, segment: str = "256MB", *, timeout: float = 20.0
) -> Iterator[subprocess.Popen[bytes]]:
    """A store node for the block: Mooncake's standalone ``mooncake_client`` adding a
    ``segment`` of its memory to ``master``'s store, so objects of clients that add none
    (``--artifact-mooncake-segment 0``) outlive those clients."""
    (port,) = _free_ports(1)
    command = [
        str(Path(master_binary()).with_name("mooncake_client")),
        f"--global_segment_size={segment}",
        f"--host={_HOST}",
        f"--master_server_address={master.master_address}",
        f"--metadata_server={master.metadata_url}",
        f"--port={port}",
    ]
    log = Path(tempfile.mkdtemp(prefix="mooncake-store-node-")) / "mooncake_client.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=client_env())
    try:
        deadline = time.monotonic() + timeout
        while not port_accepts(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_client did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
