"""The patch registry (``vllm_artifact/integration/hooks/__init__.py``) against what the plugin
really does to vLLM: the wraps it installs, the methods our subclasses override, the private
state they use, the entry points it registers. Each side is found at runtime (or in our
source), never read from the registry, so a patch without an entry, or an entry without its
patch, fails here."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import inspect
import pkgutil
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import vllm_artifact.integration as integration
from vllm_artifact.integration.hooks import INSTALLED, PATCHES, Kind, apply_all
from vllm_artifact.integration.seams import SERIES

apply_all()
#: The registry's entries for the installed vLLM's series (0.32 here; the GPU harness runs
#: this module on 0.34 too).
CURRENT = tuple(p for p in PATCHES if SERIES in p.series)
PACKAGE = Path(integration.__file__).parent

#: Modules vLLM loads to serve (the API routers and serving classes, the engine client) and
#: offline (LLM and its engine). Some hooks patch a module only when vLLM loads it, so they are
#: imported here as vLLM would.
LOADED_BY_VLLM = (
    "vllm.entrypoints.openai.completion.api_router",
    "vllm.entrypoints.openai.chat_completion.api_router",
    "vllm.entrypoints.scale_out.token_in_token_out.api_router",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.scale_out.token_in_token_out.serving",
    "vllm.v1.engine.async_llm",
    "vllm.entrypoints.llm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.worker.gpu.model_runner",
)


def registered(*kinds: Kind) -> set[tuple[str, str]]:
    return {(target, p.hook) for p in CURRENT if p.kind in kinds for target in p.targets}


def test_every_installed_wrap_is_registered_and_every_registered_wrap_is_installed() -> None:
    for name in LOADED_BY_VLLM:
        importlib.import_module(name)
    installed = set(INSTALLED.items())
    assert installed == registered(Kind.WRAP, Kind.REPLACE)


# ------------------------------------------------------------------- our subclasses of vLLM


def our_modules() -> list[ModuleType]:
    """Our integration modules, but the seam modules of other vLLM series."""
    modules = [
        importlib.import_module(info.name)
        for info in pkgutil.walk_packages([str(PACKAGE)], prefix=f"{integration.__name__}.")
    ]
    return [m for m in modules if getattr(m, "SERIES", SERIES) == SERIES]


def is_vllm(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "vllm"


def is_ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "vllm_artifact"


def vllm_subclasses() -> list[type]:
    """Classes defined in vllm_artifact.integration with a vLLM class among their bases."""
    return [
        cls
        for module in our_modules()
        for cls in vars(module).values()
        if isinstance(cls, type)
        and cls.__module__ == module.__name__
        and any(is_vllm(base) for base in cls.__mro__)
    ]


def members(cls: type) -> list[str]:
    """What a class of ours defines (ABCMeta's ``_abc_impl`` is not code of ours)."""
    return [
        name
        for name in vars(cls)
        if (not name.startswith("__") or name == "__init__") and name != "_abc_impl"
    ]


def hook_of(cls: type) -> str:
    return cls.__module__.rpartition(".")[2]


def qualified(cls: type, name: str) -> str:
    return f"{cls.__module__}.{cls.__qualname__}.{name}"


def test_every_override_of_a_vllm_method_is_registered() -> None:
    found: set[tuple[str, str]] = set()
    for cls in vllm_subclasses():
        for ours in (c for c in cls.__mro__ if is_ours(c)):
            for name in members(ours):
                effective = next(c for c in cls.__mro__ if name in vars(c))
                owner = next((c for c in cls.__mro__ if is_vllm(c) and name in vars(c)), None)
                if owner is not None and effective is ours:
                    found.add((qualified(owner, name), hook_of(ours)))
    assert found == registered(Kind.OVERRIDE)


def self_attributes(cls: type) -> tuple[set[str], set[str]]:
    """Private ``self._x`` names the class's own code reads or writes, and those its
    ``__init__`` assigns (attributes it introduces)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    used, introduced = set(), set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            used.add(node.attr)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for assign in ast.walk(node):
                targets = getattr(assign, "targets", None) or [getattr(assign, "target", None)]
                for target in targets:
                    for element in getattr(target, "elts", [target]):
                        if isinstance(element, ast.Attribute):
                            introduced.add(element.attr)
    return used, introduced


def defines(cls: type, name: str) -> bool:
    """Whether vLLM class ``cls`` has ``name`` as a class attribute or assigns it to self."""
    return name in vars(cls) or f"self.{name}" in inspect.getsource(cls)


def test_every_private_vllm_name_our_subclasses_use_is_registered() -> None:
    found: set[tuple[str, str]] = set()
    for cls in vllm_subclasses():
        ours = [c for c in cls.__mro__ if is_ours(c)]
        own: set[str] = set()
        used: dict[str, set[str]] = {}  # the names each part of ours uses
        for part in ours:
            part_used, introduced = self_attributes(part)
            used[hook_of(part)] = used.get(hook_of(part), set()) | part_used
            own |= introduced | set(vars(part))
        for hook, names in used.items():
            for name in names - own:
                owner = next(c for c in cls.__mro__ if is_vllm(c) and defines(c, name))
                found.add((qualified(owner, name), hook))
    owners = {
        qualified(base, "") for cls in vllm_subclasses() for base in cls.__mro__ if is_vllm(base)
    }
    assert found == {
        (target, hook)
        for target, hook in registered(Kind.PRIVATE)
        if target.rpartition(".")[0] + "." in owners
    }


# ------------------------------------------------------------------------ every target


def resolve(target: str) -> Any:
    """The vLLM object a dotted target names (a field of a dataclass or msgspec struct, or an
    attribute a class assigns to self, resolves to its class)."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif isinstance(obj, type) and (
                name in getattr(obj, "__dataclass_fields__", {})
                or name in getattr(obj, "__struct_fields__", ())
                or defines(obj, name)
            ):
                return obj
            else:
                raise AttributeError(f"{target}: {name} not found")
        return obj
    raise ImportError(target)


@pytest.mark.parametrize(
    "target",
    [t for p in CURRENT if p.kind is not Kind.ENTRY_POINT for t in p.targets],
)
def test_every_registered_target_exists_in_the_installed_vllm(target: str) -> None:
    resolve(target)


def test_every_entry_point_into_vllm_is_registered() -> None:
    groups = {
        (entry.group, entry.value.split(":")[0].rpartition(".")[2])
        for entry in importlib.metadata.distribution("vllm-artifact").entry_points
        if entry.group.startswith("vllm.")
    }
    assert groups == registered(Kind.ENTRY_POINT)


def test_every_entry_names_series_we_hook() -> None:
    for patch in PATCHES:
        assert patch.series and set(patch.series) <= {"0.32", "0.34"}, patch.targets


def test_every_entry_is_documented() -> None:
    for patch in PATCHES:
        assert all((patch.why, patch.how, patch.upstream, patch.removal)), patch.targets


# ------------------------------------------------------- no patch outside the registry


def vllm_names(tree: ast.Module) -> set[str]:
    """Names a module binds to vLLM modules or objects by importing them."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    names.add(alias.asname or "vllm")
    return names


def test_no_vllm_name_is_assigned_except_through_wrap_once() -> None:
    """A patch that bypasses wrap_once would escape the runtime comparison above."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = vllm_names(tree)
        for node in ast.walk(tree):
            owners: list[ast.expr] = []  # the objects whose attribute is set
            if isinstance(node, ast.Assign):
                owners = [t.value for t in node.targets if isinstance(t, ast.Attribute)]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                if isinstance(node.target, ast.Attribute):
                    owners = [node.target.value]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "setattr",
                "delattr",
            ):
                owners = node.args[:1]
            for owner in owners:
                while isinstance(owner, ast.Attribute):
                    owner = owner.value
                if isinstance(owner, ast.Name) and owner.id in names:
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert found == []
