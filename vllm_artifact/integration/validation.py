"""Startup checks for routed-experts output: fail before any engine process starts.

Each message says what is wrong and what to do, naming the flag or variable to change.
"""

from __future__ import annotations

from vllm_artifact.errors import ArtifactConfigError


def check_before_config(*, enabled: bool) -> None:
    """Checks that need only the environment (run before vLLM builds its config)."""
    if not enabled:
        return
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER is False:
        raise ArtifactConfigError(
            "--enable-routed-experts needs vLLM's Model Runner V2 (routed experts are captured "
            "there), but VLLM_USE_V2_MODEL_RUNNER=0 selects Model Runner V1. Unset "
            "VLLM_USE_V2_MODEL_RUNNER or set it to 1."
        )
