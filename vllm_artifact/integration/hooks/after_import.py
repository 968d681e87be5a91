"""Run a callback right after a module is first imported (standard library only).

For hooks whose target module cannot be imported when hooks are installed: importing it
then could close an import cycle that vLLM is in the middle of (hooks are installed while
``vllm.engine.arg_utils`` loads, see ``early_import``), so the hook waits for vLLM to import
the module itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any


class _LoaderThenCall(importlib.abc.Loader):
    def __init__(
        self, inner: importlib.abc.Loader, callbacks: list[Callable[[ModuleType], None]]
    ) -> None:
        self._inner, self._callbacks = inner, callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for callback in self._callbacks:
            callback(module)
        apply_pending()


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself; wraps the real loader of one module, once, to call every
    callback registered for it (one watcher per module: the import system asks only the
    first finder that answers)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.callbacks: list[Callable[[ModuleType], None]] = []

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThenCall(spec.loader, self.callbacks)
        return spec


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` right after module ``name`` (not imported yet) has executed.
    Asking twice for the same name and callback calls it once."""
    for finder in sys.meta_path:
        if isinstance(finder, _ImportWatcher) and finder.name == name:
            if callback not in finder.callbacks:
                finder.callbacks.append(callback)
            return
    watcher = _ImportWatcher(name)
    watcher.callbacks.append(callback)
    sys.meta_path.insert(0, watcher)


def is_watched(name: str) -> bool:
    """Whether some callback waits for module ``name``."""
    return any(isinstance(f, _ImportWatcher) and f.name == name for f in sys.meta_path)


#: Patches of modules that were being imported (``attribute`` not defined yet) when asked for.
_PENDING: list[tuple[str, str, Callable[[ModuleType], None]]] = []


def patch_module(name: str, attribute: str, patch: Callable[[ModuleType], None]) -> bool:
    """``patch(module)`` now if module ``name`` is loaded (far enough to define ``attribute``),
    else right after it is first imported. If it is being imported and has not defined
    ``attribute`` yet (hooks install while ``vllm.engine.arg_utils`` loads, which such a
    module may be importing), the patch waits for :func:`apply_pending` and False is
    returned."""
    module = sys.modules.get(name)
    if module is None:
        when_imported(name, patch)
        return True
    if attribute not in module.__dict__:
        _PENDING.append((name, attribute, patch))
        return False
    patch(module)
    return True


def apply_pending() -> None:
    """Apply the waiting patches whose module has now defined its attribute. Called after
    every watched module loads and when an engine's configuration is made (EngineArgs'
    ``create_engine_config``, which runs before any engine is built, with vLLM's engine
    modules fully imported)."""
    for entry in list(_PENDING):
        name, attribute, patch = entry
        module = sys.modules.get(name)
        if module is not None and attribute in module.__dict__ and entry in _PENDING:
            _PENDING.remove(entry)
            patch(module)


def pending() -> list[str]:
    """Modules whose patch still waits (tests, diagnostics)."""
    return [name for name, _, _ in _PENDING]
