"""Hook: our options on vLLM's ``EngineArgs`` (CLI flags, LLM keywords, startup checks;
registry: ``hooks/__init__.py``, hook ``engine_args``).

Every wrapper calls the original; with R3 off and our options absent the arguments reach vLLM
unchanged, which is why this hook alone is installed on an unsupported vLLM (its startup
checks then refuse R3 with the supported range). The logic lives in ``options.py`` (flags,
keywords, ``additional_config``) and ``validation.py`` (startup refusals, scheduler class).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from vllm.engine import arg_utils

from vllm_artifact.integration import options, validation
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.hooks.after_import import apply_pending
from vllm_artifact.integration.hooks.patching import require, require_attributes, wrap_once
from vllm_artifact.integration.metrics import register_store_metrics

_WRAPPED = ("add_cli_args", "from_cli_args", "__init__", "create_engine_config")
require_attributes("engine_args", *((arg_utils.EngineArgs, _name) for _name in _WRAPPED))
# EngineArgs fields our options and startup checks read or write.
_FIELDS = (
    "enable_return_routed_experts",
    "aux_output_config",
    "additional_config",
    "scheduler_cls",
    "pipeline_parallel_size",
    "decode_context_parallel_size",
    "prefill_context_parallel_size",
    "kv_transfer_config",
    "enable_prefix_caching",
)
for _field in _FIELDS:
    require(
        _field in arg_utils.EngineArgs.__dataclass_fields__,
        "engine_args",
        f"vllm.engine.arg_utils.EngineArgs.{_field} is gone",
    )


def _add_cli_args(original: Any) -> Any:
    @functools.wraps(original)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original(parser, *args, **kwargs)
        options.add_cli_args(parser)
        return parser

    return add_cli_args


def _from_cli_args(original: Any) -> Any:
    func = original.__func__

    @functools.wraps(func)
    def from_cli_args(cls: Any, args: argparse.Namespace) -> Any:
        if getattr(args, options.ENABLE_KWARG, False):
            setattr(args, options.VLLM_ENABLE_FIELD, True)
        engine_args = func(cls, args)
        # vLLM passes only its own dataclass fields to __init__; add our flags afterwards.
        store_options = options.from_namespace(args)
        if store_options:
            options.attach_store_options(engine_args, store_options)
        return engine_args

    return classmethod(from_cli_args)


def _init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        ours = options.pop_artifact_kwargs(kwargs)
        options.apply_to_engine_kwargs(kwargs, ours)
        original(self, *args, **kwargs)
        # After vLLM's __post_init__: aux_output_config now says whether R3 is on.
        options.attach_store_options(self, ours)

    return __init__


def _create_engine_config(original: Any) -> Any:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        apply_pending()  # hooks of engine modules that were mid-import at install time
        if not self.aux_output_config.enable_return_routed_experts:
            return original(self, *args, **kwargs)
        validation.check_engine_args(self)  # the vLLM version first: seams need a known one
        from vllm_artifact.integration.seams import prepare_engine_args

        prepare_engine_args(self)
        try:
            vllm_config = original(self, *args, **kwargs)
        except ValueError as err:
            ours = validation.translate_upstream_error(err, self)
            if ours is None:
                raise
            raise ours from err
        validation.check_vllm_config(vllm_config)
        validation.set_scheduler_cls(vllm_config)
        # This process serves /metrics when it is vLLM's API server.
        register_store_metrics(ArtifactConfig.from_vllm_config(vllm_config).root)
        return vllm_config

    return create_engine_config


def install() -> None:
    engine_args = arg_utils.EngineArgs
    wrap_once(engine_args, "add_cli_args", lambda sm: staticmethod(_add_cli_args(sm.__func__)))
    wrap_once(engine_args, "from_cli_args", _from_cli_args)
    wrap_once(engine_args, "create_engine_config", _create_engine_config)
    for cls in (engine_args, arg_utils.AsyncEngineArgs):
        wrap_once(cls, "__init__", _init)
