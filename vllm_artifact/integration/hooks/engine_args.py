"""Hook: our options on vLLM's ``EngineArgs`` (CLI flag, LLM keyword, startup checks).

Replaces (wraps) ``EngineArgs.add_cli_args``, ``EngineArgs.from_cli_args``,
``EngineArgs.__init__``, ``AsyncEngineArgs.__init__`` and ``EngineArgs.create_engine_config``.
Checked against vLLM 0.32.0. Every wrapper calls the original; with our options absent the
arguments reach vLLM unchanged.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from vllm.engine import arg_utils

from vllm_artifact.integration import options, validation

_WRAPPED = ("add_cli_args", "from_cli_args", "__init__", "create_engine_config")
for _name in _WRAPPED:
    assert hasattr(arg_utils.EngineArgs, _name), (
        f"vllm.engine.arg_utils.EngineArgs.{_name} is gone; vllm-artifact's engine_args hook "
        "was written for vLLM 0.32 and must be updated"
    )
assert "enable_return_routed_experts" in arg_utils.EngineArgs.__dataclass_fields__, (
    "EngineArgs.enable_return_routed_experts is gone; update vllm-artifact's engine_args hook"
)

_MARK = "__vllm_artifact_wrapped__"


def _add_cli_args(original: Any) -> Any:
    @functools.wraps(original)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        group = parser.add_argument_group(
            title="Artifact Connector (vllm-artifact)",
            description="Routed-experts (R3) output for RL training of MoE models.",
        )
        group.add_argument(
            options.ENABLE_FLAG,
            dest=options.ENABLE_KWARG,
            action="store_true",
            default=False,
            help="Return, on each finished completion, the top-k expert IDs the router chose "
            "for every token and MoE layer (base64 .npy in HTTP responses, a numpy array "
            "offline). Same as vLLM's --enable-return-routed-experts.",
        )
        return parser

    return add_cli_args


def _from_cli_args(original: Any) -> Any:
    func = original.__func__

    @functools.wraps(func)
    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        if getattr(args, options.ENABLE_KWARG, False):
            setattr(args, options.VLLM_ENABLE_FIELD, True)
        return func(cls, args)

    return classmethod(from_cli_args)


def _init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        ours = options.pop_artifact_kwargs(kwargs)
        options.apply_to_engine_kwargs(kwargs, ours)
        original(self, *args, **kwargs)

    return __init__


def _create_engine_config(original: Any) -> Any:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        enabled = bool(
            self.enable_return_routed_experts or self.aux_output_config.enable_return_routed_experts
        )
        validation.check_before_config(enabled=enabled)
        return original(self, *args, **kwargs)

    return create_engine_config


def _wrap(owner: type, name: str, make: Any) -> None:
    current = owner.__dict__[name]
    if getattr(current, _MARK, False) or getattr(getattr(current, "__func__", None), _MARK, False):
        return
    wrapped = make(current)
    target = getattr(wrapped, "__func__", wrapped)
    setattr(target, _MARK, True)
    setattr(owner, name, wrapped)


def install() -> None:
    engine_args = arg_utils.EngineArgs
    _wrap(engine_args, "add_cli_args", lambda sm: staticmethod(_add_cli_args(sm.__func__)))
    _wrap(engine_args, "from_cli_args", _from_cli_args)
    _wrap(engine_args, "create_engine_config", _create_engine_config)
    for cls in (engine_args, arg_utils.AsyncEngineArgs):
        _wrap(cls, "__init__", _init)
