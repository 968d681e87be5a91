"""Hook: install our hooks right after ``vllm.engine.arg_utils`` loads (see hooks/__init__).

Registered under vLLM's ``vllm.platform_plugins`` entry point group. It must not touch
``vllm.platforms.current_platform`` (vLLM is resolving it when it calls us) and it never claims
a platform (returns None), so vLLM's platform choice is unchanged. Checked against vLLM 0.32.0.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_TARGET = "vllm.engine.arg_utils"


class _LoaderThatAppliesHooks(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        from vllm_artifact.integration.plugin import register

        register()


class _ArgUtilsWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of ``vllm.engine.arg_utils`` once."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThatAppliesHooks(spec.loader)
        return spec


def platform_plugin() -> None:
    """vLLM platform-plugin entry point that only schedules our hooks; claims no platform."""
    if _TARGET in sys.modules or any(isinstance(f, _ArgUtilsWatcher) for f in sys.meta_path):
        return None
    sys.meta_path.insert(0, _ArgUtilsWatcher())
    return None
