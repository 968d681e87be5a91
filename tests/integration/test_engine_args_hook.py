"""Our enable flag on vLLM's EngineArgs: CLI flag, LLM keyword, both spellings, hook basics.

These use vLLM's real argument parser and EngineArgs (no engine is started). The store options
and the startup refusals are tested in test_config.py.
"""

from __future__ import annotations

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_artifact.errors import ArtifactConfigError
from vllm_artifact.integration.plugin import register
from vllm_artifact.selftest.tiny_models import ensure_tiny_model

# A local model directory: vLLM resolves model names, and the e2e tests put the process in
# Hugging Face offline mode (no hub on these machines), where a made-up name cannot resolve.
MODEL = str(ensure_tiny_model("qwen3-moe-8x2"))


@pytest.fixture
def parser() -> FlexibleArgumentParser:
    # Fresh per test: vLLM 0.32's parser shares one default AuxOutputConfig, which
    # EngineArgs.__post_init__ mutates when routed experts are enabled (see test_config.py).
    register()
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def parse(parser: FlexibleArgumentParser, *flags: str) -> AsyncEngineArgs:
    args = parser.parse_args(["--model", MODEL, *flags])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert isinstance(engine_args, AsyncEngineArgs)
    return engine_args


@pytest.mark.parametrize(
    "flags, enabled",
    [
        ((), False),
        (("--enable-routed-experts",), True),
        (("--enable-return-routed-experts",), True),
    ],
)
def test_both_spellings_enable_vllm_capture(
    parser: FlexibleArgumentParser, flags: tuple[str, ...], enabled: bool
) -> None:
    engine_args = parse(parser, *flags)
    assert engine_args.enable_return_routed_experts is enabled
    assert engine_args.aux_output_config.enable_return_routed_experts is enabled


def test_flag_is_documented_in_help(parser: FlexibleArgumentParser) -> None:
    assert "--enable-routed-experts" in parser.format_help()


def test_keyword_argument_enables_capture() -> None:
    register()
    engine_args = EngineArgs(model=MODEL, enable_routed_experts=True)
    assert engine_args.aux_output_config.enable_return_routed_experts is True
    assert EngineArgs(model=MODEL).aux_output_config.enable_return_routed_experts is False


def test_keyword_argument_rejects_non_bool() -> None:
    register()
    with pytest.raises(TypeError, match="enable_routed_experts must be True or False"):
        EngineArgs(model=MODEL, enable_routed_experts="yes")


def test_register_is_idempotent(caplog: pytest.LogCaptureFixture) -> None:
    register()
    with caplog.at_level("INFO"):
        register()
        register()
    assert "hooks installed" not in caplog.text


def test_model_runner_v1_rejected_before_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    register()
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    model = ensure_tiny_model("qwen3-moe-8x2")
    engine_args = EngineArgs(model=str(model), enable_routed_experts=True)
    with pytest.raises(ArtifactConfigError, match="Unset VLLM_USE_V2_MODEL_RUNNER or set it to 1"):
        engine_args.create_engine_config()


def test_without_our_options_engine_args_are_unchanged() -> None:
    register()
    plain = EngineArgs(model=MODEL, max_num_seqs=3)
    assert plain.enable_return_routed_experts is False
    assert plain.max_num_seqs == 3
