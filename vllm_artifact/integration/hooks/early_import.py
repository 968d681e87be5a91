"""Hook: install our hooks right after ``vllm.engine.arg_utils`` loads (registry:
``hooks/__init__.py``, hook ``early_import``).

Registered under vLLM's ``vllm.platform_plugins`` entry point group. It must not touch
``vllm.platforms.current_platform`` (vLLM is resolving it when it calls us) and it never claims
a platform (returns None), so vLLM's platform choice is unchanged.
"""

from __future__ import annotations

import sys
from types import ModuleType

from vllm_artifact.integration.hooks.after_import import is_watched, when_imported

_TARGET = "vllm.engine.arg_utils"


def _register(module: ModuleType) -> None:
    from vllm_artifact.integration.plugin import register

    register()


def platform_plugin() -> None:
    """vLLM platform-plugin entry point that only schedules our hooks; claims no platform."""
    if _TARGET in sys.modules or is_watched(_TARGET):
        return None
    when_imported(_TARGET, _register)
    return None
