"""Unsupported combinations fail at startup with a message that says what to do."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from vllm_artifact_testing.engine_env import apply_cpu_engine_env, engine_cli_args
from vllm_artifact_testing.server import free_port, vllm_command

pytestmark = pytest.mark.engine


def test_serve_with_model_runner_v1_is_rejected(model_a: Path) -> None:
    env = apply_cpu_engine_env(dict(os.environ))
    env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    result = subprocess.run(
        [
            *vllm_command(),
            "serve",
            str(model_a),
            *engine_cli_args(),
            "--enable-routed-experts",
            # vLLM binds the port before it checks the config: never a port in use.
            *("--host", "127.0.0.1", "--port", str(free_port())),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "ArtifactConfigError" in output
    assert "needs vLLM's Model Runner V2" in output
    assert "VLLM_USE_V2_MODEL_RUNNER" in output
    # Rejected before any engine process started.
    assert "EngineCore" not in output
