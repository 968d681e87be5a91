"""How a hook changes a vLLM name: checked first (:func:`require`), wrapped once
(:func:`wrap_once`), and recorded (:data:`INSTALLED`) so a test can compare what the plugin
really installed with the registry in ``hooks/__init__.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_artifact.errors import VllmIncompatibleError

#: Set on every function a hook installs, so installing twice never wraps twice.
WRAPPED_MARK = "__vllm_artifact_wrapped__"

#: Every vLLM name that carries one of our wraps in this process: dotted name -> the hook
#: module that made the wrap. Filled by :func:`wrap_once` only.
INSTALLED: dict[str, str] = {}


def require(condition: object, hook: str, what: str) -> None:
    """A hook's check of the vLLM it wraps, at install time: a typed error naming the hook
    (``assert`` would vanish under ``python -O``)."""
    if not condition:
        from vllm_artifact.integration.hooks.versions import support

        supported = support()
        raise VllmIncompatibleError(
            f"{what}; vllm-artifact's {hook} hook was written for {supported.wanted()}: "
            f"install a release in that range ({supported.install_hint()}) or a "
            "vllm-artifact release made for yours"
        )


def require_attributes(hook: str, *names: tuple[Any, str]) -> None:
    """:func:`require` that each ``(owner, name)`` exists."""
    for owner, name in names:
        label = str(getattr(owner, "__qualname__", None) or getattr(owner, "__name__", owner))
        module = getattr(owner, "__module__", None)
        where = f"{module}.{label}" if module and not label.startswith(module) else label
        require(hasattr(owner, name), hook, f"{where}.{name} is gone")


def dotted_name(owner: Any, name: str) -> str:
    """``owner.name`` as the registry spells it: the module path of a module global, the
    defining module and qualified name of a class attribute."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{owner.__name__}.{name}"


def wrap_once(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` (a class attribute or a module global) with ``make(current)``,
    unless a hook already did, and record it in :data:`INSTALLED` either way (a module that
    imported a wrapped function after we wrapped it holds our wrap too). ``make`` receives and
    returns the raw attribute, so static and class methods keep their descriptor; its module
    names the hook."""
    current = owner.__dict__[name]
    if not (
        getattr(current, WRAPPED_MARK, False)
        or getattr(getattr(current, "__func__", None), WRAPPED_MARK, False)
    ):
        wrapped = make(current)
        setattr(getattr(wrapped, "__func__", wrapped), WRAPPED_MARK, True)
        setattr(owner, name, wrapped)
    INSTALLED.setdefault(dotted_name(owner, name), make.__module__.rpartition(".")[2])
