"""``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process."""

from __future__ import annotations

import logging

from vllm_artifact.integration.hooks import apply_all

# Under vLLM's logger namespace so the line appears with vLLM's own handler and format.
logger = logging.getLogger("vllm.artifact")


def register() -> None:
    """Install vllm-artifact's hooks; idempotent, logs once per process. On a vLLM outside
    the supported range it installs only the check that refuses R3 (and logs why)."""
    if apply_all():
        logger.info("vllm-artifact: hooks installed (--enable-routed-experts available)")
