"""The user-facing options of the Artifact Connector: one table for CLI flags and LLM kwargs.

Both spellings of the enable flag mean the same thing: ``--enable-routed-experts`` is ours
(canonical), ``--enable-return-routed-experts`` is vLLM's own and keeps working unchanged.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

#: ``LLM(...)`` / ``EngineArgs(...)`` keyword that turns routed-experts (R3) output on.
ENABLE_KWARG = "enable_routed_experts"
#: Canonical CLI flag; vLLM's ``--enable-return-routed-experts`` stays an alias.
ENABLE_FLAG = "--enable-routed-experts"
#: vLLM's own EngineArgs field that switches capture on (compile hash and call sites key off it).
VLLM_ENABLE_FIELD = "enable_return_routed_experts"

OUR_KWARGS = frozenset({ENABLE_KWARG})


def pop_artifact_kwargs(kwargs: MutableMapping[str, Any]) -> dict[str, Any]:
    """Remove our keyword arguments from ``kwargs`` and return them (validated types)."""
    ours = {name: kwargs.pop(name) for name in OUR_KWARGS if name in kwargs}
    enable = ours.get(ENABLE_KWARG)
    if enable is not None and not isinstance(enable, bool):
        raise TypeError(
            f"{ENABLE_KWARG} must be True or False, got {enable!r} ({type(enable).__name__})"
        )
    return ours


def apply_to_engine_kwargs(kwargs: MutableMapping[str, Any], ours: dict[str, Any]) -> None:
    """Translate our options into fields vLLM's ``EngineArgs`` already has.

    ``enable_routed_experts=True`` turns on vLLM's own capture flag: the capturer, the compile
    hash and every call site key off it, so both spellings end in the same configuration.
    """
    if ours.get(ENABLE_KWARG):
        kwargs[VLLM_ENABLE_FIELD] = True
