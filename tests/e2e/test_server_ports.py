"""The test servers' start-up: a port taken before ``vllm serve`` binds it is retried.

``free_port`` finds a port nobody holds, but it stays free only until someone binds it; on a
busy machine (or with another server's engine opening its ZMQ sockets meanwhile) ``vllm
serve`` may then fail with EADDRINUSE, a failure of the test machinery, not of the code under
test.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from vllm_artifact_testing import server

pytestmark = pytest.mark.engine


def test_a_server_whose_port_was_taken_starts_again_on_another(
    model_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = iter([taken, server.free_port()])
        monkeypatch.setattr(server, "free_port", lambda: next(ports))
        # The second start fails on purpose once it has bound its port (vLLM binds before it
        # checks the config), so the test costs two imports of vLLM, not a whole engine.
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        spec = (model_a, ["--enable-routed-experts"])
        with pytest.raises(RuntimeError) as raised, server.vllm_servers([spec], log_dir=tmp_path):
            pass
    assert not isinstance(raised.value, server._PortTaken), raised.value
    assert "needs vLLM's Model Runner V2" in str(raised.value)
    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.iterdir()}
    assert len(logs) == 2, sorted(logs)  # one start per port
    assert "Address already in use" in logs.pop(f"vllm-serve-{taken}.log")
