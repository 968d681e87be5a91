"""Unsupported combinations fail at startup with a message that says what to do."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from vllm_artifact_testing import server

pytestmark = pytest.mark.engine


def test_serve_with_model_runner_v1_is_rejected(
    model_a: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also checks the test servers' start-up: ``free_port`` hands out a port this test holds
    first, so the server exits with EADDRINUSE and ``vllm_servers`` must start it again on
    another port (a race of the test machinery, not of the code under test; in this test it
    costs one more import of vLLM instead of a test of its own)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        ports = iter([taken, server.free_port()])
        monkeypatch.setattr(server, "free_port", lambda: next(ports))
        spec = (model_a, ["--enable-routed-experts"])
        with pytest.raises(RuntimeError) as raised, server.vllm_servers([spec], log_dir=tmp_path):
            pass
    assert not isinstance(raised.value, server._PortTaken), raised.value
    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.iterdir()}
    assert len(logs) == 2, sorted(logs)  # one start per port
    assert "Address already in use" in logs.pop(f"vllm-serve-{taken}.log")
    (output,) = logs.values()
    assert "ArtifactConfigError" in output
    assert "needs vLLM's Model Runner V2" in output
    assert "VLLM_USE_V2_MODEL_RUNNER" in output
    # Rejected before any engine process started (vLLM binds its port before it checks).
    assert "EngineCore" not in output
