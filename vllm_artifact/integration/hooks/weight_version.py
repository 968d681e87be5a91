"""Hook: check vLLM's weight version before vLLM records it, and forward it to our connector
(registry: ``hooks/__init__.py``, hook ``weight_version``).

vLLM keeps the weight version on the EngineCore only (behind ``LLM.update_weight_version``,
``POST /update_weight_version`` and ``finish_weight_update``), where neither the scheduler nor
the workers see it, and accepts any string. Our object keys include it and cannot carry an empty
string, one over 4096 characters or one that is not valid Unicode: such a version reaching the
step path would kill the engine. So every setter checks it first
(:func:`~vllm_artifact.core.keys.check_weight_version`): a bad version raises
``WeightVersionError`` (a ``ValueError``: HTTP 400 on the server) and the engine keeps its
version. The frontend setters are checked where the caller is (a clear error, not a failed
utility call); EngineCore's check covers every other way in. EngineCore's setter then also
tells our scheduler connector, which ships the version to the worker with every step.
"""

from __future__ import annotations

import functools
import inspect
import logging
from types import ModuleType
from typing import Any

from vllm.v1.engine.core import EngineCore

from vllm_artifact.core.keys import check_weight_version
from vllm_artifact.integration.hooks.after_import import patch_module
from vllm_artifact.integration.hooks.patching import require_attributes, wrap_once

logger = logging.getLogger("vllm.artifact")

_HOOK = "weight_version"
require_attributes(_HOOK, (EngineCore, "set_weight_version"))

#: Frontend setters: (module, class, method, name of the version argument). Patched when vLLM
#: loads the module (the API server never loads the offline engine, and the reverse).
_FRONTEND_SETTERS = (
    ("vllm.v1.engine.llm_engine", "LLMEngine", "set_weight_version", "weight_version"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "update_weight_version", "new_version"),
    ("vllm.v1.engine.async_llm", "AsyncLLM", "finish_weight_update", "weight_version"),
    ("vllm.entrypoints.rl.offline", "RLOfflineMixin", "finish_weight_update", "weight_version"),
)


def _wrap_set_weight_version(original: Any) -> Any:
    @functools.wraps(original)
    def set_weight_version(self: Any, weight_version: str) -> None:
        check_weight_version(weight_version)
        original(self, weight_version)
        connector = getattr(getattr(self, "scheduler", None), "aux_output_connector", None)
        setter = getattr(connector, "set_weight_version", None)
        if setter is not None:
            setter(weight_version)

    return set_weight_version


def _checking(argument: str, *, optional: bool) -> Any:
    """A wrap that checks the version argument before the original runs (sync or async)."""

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        value = kwargs[argument] if argument in kwargs else (args[0] if args else None)
        if value is not None or not optional:
            check_weight_version(value)

    def wrap(original: Any) -> Any:
        if inspect.iscoroutinefunction(original):

            @functools.wraps(original)
            async def checked_async(self: Any, *args: Any, **kwargs: Any) -> Any:
                check(args, kwargs)
                return await original(self, *args, **kwargs)

            return checked_async

        @functools.wraps(original)
        def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
            check(args, kwargs)
            return original(self, *args, **kwargs)

        return checked

    return wrap


def _patch_setters(module: ModuleType) -> None:
    for module_name, owner_name, method, argument in _FRONTEND_SETTERS:
        if module_name != module.__name__:
            continue
        require_attributes(_HOOK, (module, owner_name))
        owner = getattr(module, owner_name)
        require_attributes(_HOOK, (owner, method))
        wrap_once(owner, method, _checking(argument, optional=method == "finish_weight_update"))


def install() -> None:
    wrap_once(EngineCore, "set_weight_version", _wrap_set_weight_version)
    for module_name, owner_name in dict.fromkeys((m, o) for m, o, *_ in _FRONTEND_SETTERS):
        if not patch_module(module_name, owner_name, _patch_setters):
            logger.debug("vllm-artifact: %s is being imported; patched once it is", module_name)
