"""Hook: forward vLLM's weight version to our scheduler connector.

Wraps ``vllm.v1.engine.core.EngineCore.set_weight_version`` (the setter behind
``/update_weight_version`` and ``LLM.set_weight_version``; vLLM keeps the version on the
EngineCore only, where neither the scheduler nor the workers see it). Our scheduler connector
then ships it to the worker with every step, and object keys include it. Checked against
vLLM 0.32.0.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm.v1.engine.core import EngineCore

from vllm_artifact.integration.hooks import wrap_once

assert hasattr(EngineCore, "set_weight_version"), (
    "vllm.v1.engine.core.EngineCore.set_weight_version is gone; update vllm-artifact's "
    "weight_version hook"
)


def _wrap_set_weight_version(original: Any) -> Any:
    @functools.wraps(original)
    def set_weight_version(self: Any, weight_version: str) -> None:
        original(self, weight_version)
        connector = getattr(getattr(self, "scheduler", None), "aux_output_connector", None)
        setter = getattr(connector, "set_weight_version", None)
        if setter is not None:
            setter(weight_version)

    return set_weight_version


def install() -> None:
    wrap_once(EngineCore, "set_weight_version", _wrap_set_weight_version)
