"""ArtifactConfig, the --artifact-* flags / artifact_* keywords, and the startup refusals.

Uses vLLM's real argument parser, ``EngineArgs`` and ``create_engine_config`` on the tiny MoE
model (a few seconds for the first config, well under one for the next); no engine starts.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm_artifact_testing.engine_env import ENGINE_KWARGS

from vllm_artifact.core.store import default_root
from vllm_artifact.errors import ArtifactConfigError
from vllm_artifact.integration import validation
from vllm_artifact.integration.config import (
    ADDITIONAL_CONFIG_KEY,
    ArtifactConfig,
    parse_duration,
    parse_size,
    parse_switch_interval,
)
from vllm_artifact.integration.plugin import register
from vllm_artifact.selftest.tiny_models import ensure_tiny_model

# A local model directory: vLLM resolves model names, and the e2e tests put the process in
# Hugging Face offline mode (no hub on these machines), where a made-up name cannot resolve.
MODEL = str(ensure_tiny_model("qwen3-moe-8x2"))

register()

KEY = ADDITIONAL_CONFIG_KEY
SYNC = "vllm_artifact.integration.scheduler.ArtifactScheduler"
ASYNC = "vllm_artifact.integration.scheduler.ArtifactAsyncScheduler"


# ------------------------------------------------------------------ sizes and durations


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GiB", 8 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1000000", 1_000_000),
        ("8 gib", 8 * 2**30),
        (" 64KiB ", 64 * 1024),
        ("auto", "auto"),
        ("AUTO", "auto"),
        (4096, 4096),
    ],
)
def test_parse_size_accepts(text: str | int, expected: int | str) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "value, match",
    [
        ("0", "more than 0"),
        (0, "more than 0"),
        (-5, "more than 0"),
        ("-1GiB", "not a size"),
        ("lots", "not a size"),
        ("8GiBs", "not a size"),
        ("", "not a size"),
        ("inf", "not a size"),
        (1.5e9, "whole number of bytes"),
        (True, "whole number of bytes"),
        (None, "whole number of bytes"),
    ],
)
def test_parse_size_rejects(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_size(value)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


@settings(max_examples=60, deadline=None)
@given(number=st.integers(min_value=1, max_value=2**20), unit=st.sampled_from(sorted(_UNITS)))
def test_parse_size_units(number: int, unit: str) -> None:
    assert parse_size(f"{number}{unit}") == number * _UNITS[unit]
    assert parse_size(number * _UNITS[unit]) == number * _UNITS[unit]


@pytest.mark.parametrize(
    "value, seconds",
    [
        ("1h", 3600.0),
        ("30m", 1800.0),
        ("90s", 90.0),
        ("2d", 172800.0),
        ("1.5h", 5400.0),
        ("3600", 3600.0),
        (" 10 M ", 600.0),
        (3600, 3600.0),
        (0.5, 0.5),
    ],
)
def test_parse_duration_accepts(value: str | float, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize(
    "value, match",
    [
        ("0", "more than 0"),
        (0, "more than 0"),
        (-1, "more than 0"),
        (math.inf, "finite"),
        (math.nan, "finite"),
        ("-1h", "not understood"),
        ("1w", "not understood"),
        ("1h30m", "not understood"),
        ("soon", "not understood"),
        (True, "number of seconds"),
        (None, "number of seconds"),
    ],
)
def test_parse_duration_rejects(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_duration(value)


@settings(max_examples=60, deadline=None)
@given(
    number=st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False),
    unit=st.sampled_from(["s", "m", "h", "d"]),
)
def test_parse_duration_units(number: float, unit: str) -> None:
    factor = {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]
    assert parse_duration(f"{number!r}{unit}") == pytest.approx(number * factor)
    assert parse_duration(number) == number


@pytest.mark.parametrize(
    "value, expected",
    [("keep", "keep"), (" KEEP ", "keep"), ("0.5", 0.5), (2, 2.0), (0.05, 0.05), ("100", 100.0)],
)
def test_parse_switch_interval_accepts(value: str | float, expected: float | str) -> None:
    assert parse_switch_interval(value) == expected


@pytest.mark.parametrize(
    "value, match",
    [
        ("0", "more than 0"),
        (-0.5, "more than 0"),
        (100.5, "at most 100"),
        (math.inf, "at most 100"),
        (math.nan, "more than 0"),
        ("5ms", "not understood"),
        (True, "number of milliseconds"),
        (None, "number of milliseconds"),
    ],
)
def test_parse_switch_interval_rejects(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_switch_interval(value)


# ------------------------------------------------------------------------ ArtifactConfig


def test_defaults() -> None:
    config = ArtifactConfig()
    assert config.enabled is False
    assert config.backend == "shm"
    assert config.root == Path(default_root())
    assert config.capacity == "auto"
    assert config.ttl_seconds == 3600.0
    assert config.switch_interval_ms == 0.5


def test_frozen_and_no_extra_fields() -> None:
    config = ArtifactConfig()
    with pytest.raises(ValidationError):
        config.capacity = 5  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs"):
        ArtifactConfig(capacty="8GiB")  # type: ignore[call-arg]


def test_rejects_relative_root_and_unknown_backend() -> None:
    with pytest.raises(ValidationError, match="absolute path"):
        ArtifactConfig(root=Path("relative/root"))
    with pytest.raises(ValidationError):
        ArtifactConfig(backend="s3")  # type: ignore[arg-type]


def test_additional_config_round_trip_is_json_safe() -> None:
    config = ArtifactConfig(
        enabled=True,
        root=Path("/dev/shm/x"),
        capacity="512MiB",  # type: ignore[arg-type]
        ttl_seconds="30m",  # type: ignore[arg-type]
        keys_lease_seconds="90s",  # type: ignore[arg-type]
        tracker="process",
        switch_interval_ms="keep",
    )
    entry = json.loads(json.dumps(config.to_additional_config()))
    assert entry == {
        "backend": "shm",
        "root": "/dev/shm/x",
        "capacity": 512 * 2**20,
        "ttl_seconds": 1800.0,
        "keys_lease_seconds": 90.0,
        "tracker": "process",
        "switch_interval_ms": "keep",
        "mooncake_master": None,
        "mooncake_metadata": "P2PHANDSHAKE",
        "mooncake_host": None,
        "mooncake_buffer": 256 * 2**20,
        "mooncake_segment": "auto",
    }
    vllm_config = SimpleNamespace(
        additional_config={KEY: entry, "other": 1},
        aux_output_config=SimpleNamespace(enable_return_routed_experts=True),
    )
    assert ArtifactConfig.from_vllm_config(vllm_config) == config


def test_from_vllm_config_defaults_and_enabled_from_vllm_flag() -> None:
    off = SimpleNamespace(
        additional_config={}, aux_output_config=SimpleNamespace(enable_return_routed_experts=False)
    )
    assert ArtifactConfig.from_vllm_config(off) == ArtifactConfig()
    with pytest.raises(ValueError, match='must not set "enabled"'):
        ArtifactConfig.from_additional_config({KEY: {"enabled": True}}, enabled=True)


# -------------------------------------------------------------- flags, keywords, inertness


@pytest.fixture
def parser() -> FlexibleArgumentParser:
    # A fresh parser per test: vLLM 0.32's parser shares one default AuxOutputConfig instance,
    # and EngineArgs.__post_init__ sets enable_return_routed_experts on it in place, so after
    # one "--enable-return-routed-experts" every later parse with the same parser has R3 on.
    return AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())


def from_cli(parser: FlexibleArgumentParser, *flags: str) -> AsyncEngineArgs:
    engine_args = AsyncEngineArgs.from_cli_args(parser.parse_args(["--model", MODEL, *flags]))
    assert isinstance(engine_args, AsyncEngineArgs)
    return engine_args


ALL_FLAGS = (
    "--artifact-backend",
    "mooncake",
    "--artifact-root",
    "/dev/shm/rl-run",
    "--artifact-capacity",
    "8GiB",
    "--artifact-ttl",
    "30m",
    "--artifact-keys-lease",
    "5m",
    "--artifact-tracker",
    "process",
    "--artifact-switch-interval-ms",
    "0.25",
    "--artifact-mooncake-master",
    "10.0.0.5:50051",
    "--artifact-mooncake-metadata",
    "http://10.0.0.5:8080/metadata",
    "--artifact-mooncake-host",
    "10.0.0.7",
    "--artifact-mooncake-buffer",
    "64MiB",
    "--artifact-mooncake-segment",
    "0",
)
ALL_ENTRY = {
    "backend": "mooncake",
    "root": "/dev/shm/rl-run",
    "capacity": 8 * 2**30,
    "ttl_seconds": 1800.0,
    "keys_lease_seconds": 300.0,
    "tracker": "process",
    "switch_interval_ms": 0.25,
    "mooncake_master": "10.0.0.5:50051",
    "mooncake_metadata": "http://10.0.0.5:8080/metadata",
    "mooncake_host": "10.0.0.7",
    "mooncake_buffer": 64 * 2**20,
    "mooncake_segment": 0,
}


@pytest.mark.parametrize("enable", ["--enable-routed-experts", "--enable-return-routed-experts"])
def test_cli_flags_reach_additional_config(parser: FlexibleArgumentParser, enable: str) -> None:
    engine_args = from_cli(parser, enable, *ALL_FLAGS, "--additional-config", '{"mine": 1}')
    assert engine_args.additional_config == {"mine": 1, KEY: ALL_ENTRY}


def test_keywords_reach_additional_config() -> None:
    user_additional = {"mine": 1}
    engine_args = EngineArgs(
        model=MODEL,
        enable_routed_experts=True,
        artifact_backend="mooncake",
        artifact_root="/dev/shm/rl-run",
        artifact_capacity="8GiB",
        artifact_ttl="30m",
        artifact_keys_lease="5m",
        artifact_tracker="process",
        artifact_switch_interval_ms=0.25,
        artifact_mooncake_master="10.0.0.5:50051",
        artifact_mooncake_metadata="http://10.0.0.5:8080/metadata",
        artifact_mooncake_host="10.0.0.7",
        artifact_mooncake_buffer="64MiB",
        artifact_mooncake_segment=0,
        additional_config=user_additional,
    )
    assert engine_args.additional_config == {"mine": 1, KEY: ALL_ENTRY}
    assert user_additional == {"mine": 1}, "the caller's dict must not be mutated"


def test_r3_on_without_store_options_writes_defaults(parser: FlexibleArgumentParser) -> None:
    expected = ArtifactConfig().to_additional_config()
    assert from_cli(parser, "--enable-routed-experts").additional_config == {KEY: expected}
    engine_args = EngineArgs(model=MODEL, aux_output_config={"enable_return_routed_experts": True})
    assert engine_args.additional_config == {KEY: expected}


def test_flags_override_additional_config_entry(parser: FlexibleArgumentParser) -> None:
    given = json.dumps({KEY: {"capacity": "1GiB", "ttl_seconds": 60}})
    engine_args = from_cli(
        parser, "--enable-routed-experts", "--additional-config", given, "--artifact-ttl", "2h"
    )
    entry = engine_args.additional_config[KEY]
    assert (entry["capacity"], entry["ttl_seconds"]) == (2**30, 7200.0)


def test_bad_additional_config_entry_is_rejected() -> None:
    with pytest.raises(ArtifactConfigError, match=r'\["vllm_artifact"\]\["capacty"\]'):
        EngineArgs(model=MODEL, enable_routed_experts=True, additional_config={KEY: {"capacty": 1}})


@pytest.mark.parametrize(
    "flag, value, example",
    [
        ("--artifact-capacity", "lots", "--artifact-capacity 8GiB"),
        ("--artifact-capacity", "0", "--artifact-capacity 8GiB"),
        ("--artifact-ttl", "soon", "--artifact-ttl 1h"),
        ("--artifact-ttl", "0s", "--artifact-ttl 1h"),
        ("--artifact-switch-interval-ms", "fast", "--artifact-switch-interval-ms 0.5"),
        ("--artifact-switch-interval-ms", "0", "--artifact-switch-interval-ms 0.5"),
    ],
)
def test_bad_cli_values_fail_while_parsing(
    parser: FlexibleArgumentParser,
    capsys: pytest.CaptureFixture[str],
    flag: str,
    value: str,
    example: str,
) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", MODEL, "--enable-routed-experts", flag, value])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err
    assert example in err


def test_unknown_backend_fails_while_parsing(
    parser: FlexibleArgumentParser, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", MODEL, "--artifact-backend", "s3"])
    assert "argument --artifact-backend: invalid choice: 's3'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"artifact_capacity": "lots"}, r"--artifact-capacity / artifact_capacity='lots'.*8GiB"),
        ({"artifact_capacity": -1}, r"artifact_capacity=-1: capacity must be more than 0"),
        ({"artifact_ttl": "1w"}, r"--artifact-ttl / artifact_ttl='1w'.*--artifact-ttl 1h"),
        ({"artifact_root": "shm/rel"}, r"artifact_root='shm/rel': root must be an absolute"),
        ({"artifact_backend": "s3"}, r"artifact_backend='s3'.*--artifact-backend mooncake"),
        (
            {"artifact_backend": "mooncake"},
            r"mooncake backend needs the master's address: --artifact-mooncake-master HOST:PORT",
        ),
        (
            {"artifact_backend": "mooncake", "artifact_mooncake_master": "10.0.0.5"},
            r"artifact_mooncake_master='10.0.0.5': must be HOST:PORT",
        ),
        ({"artifact_mooncake_buffer": "auto"}, r"takes a size, e.g. 256MiB, not 'auto'"),
        (
            {"artifact_switch_interval_ms": 500},
            r"artifact_switch_interval_ms=500: switch interval must be more than 0 and at most",
        ),
    ],
)
def test_bad_keyword_values_fail_at_engine_args(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ArtifactConfigError, match=match):
        EngineArgs(model=MODEL, enable_routed_experts=True, **kwargs)


def test_store_options_without_r3_are_rejected(parser: FlexibleArgumentParser) -> None:
    message = "--artifact-capacity has no effect without --enable-routed-experts"
    with pytest.raises(ArtifactConfigError, match=message):
        from_cli(parser, "--artifact-capacity", "8GiB")
    with pytest.raises(ArtifactConfigError, match=message):
        EngineArgs(model=MODEL, artifact_capacity="8GiB")
    with pytest.raises(ArtifactConfigError, match="--artifact-root has no effect"):
        EngineArgs(model=MODEL, enable_routed_experts=False, artifact_root="/dev/shm/x")


def _plain_engine_args(**kwargs: Any) -> EngineArgs:
    """EngineArgs built by vLLM's own (unwrapped) __init__."""
    engine_args = EngineArgs.__new__(EngineArgs)
    EngineArgs.__init__.__wrapped__(engine_args, **kwargs)  # type: ignore[misc]
    return engine_args


def test_inert_when_off(parser: FlexibleArgumentParser) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "max_num_seqs": 3, "additional_config": {"a": 1}}
    assert repr(EngineArgs(**kwargs)) == repr(_plain_engine_args(**kwargs))
    assert EngineArgs(model=MODEL).additional_config == {}
    assert from_cli(parser).additional_config == {}
    # A user's own entry is left alone (not even validated) while R3 is off.
    entry = {KEY: {"anything": "goes"}}
    assert EngineArgs(model=MODEL, additional_config=entry).additional_config == entry


def test_help_lists_every_flag(parser: FlexibleArgumentParser) -> None:
    text = parser.format_help()
    assert "Artifact Connector (vllm-artifact)" in text
    for flag in ("--enable-routed-experts", *ALL_FLAGS[::2]):
        assert flag in text


# --------------------------------------------------------------------- startup refusals


@pytest.fixture(scope="module")
def tiny_model() -> str:
    return str(ensure_tiny_model("qwen3-moe-8x2"))


@pytest.fixture(autouse=True)
def _cpu_engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private scratch directory under /dev/shm (removed afterwards)."""
    path = Path(tempfile.mkdtemp(prefix="vat-config-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def build(model: str, root: Path, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {**ENGINE_KWARGS, "artifact_root": str(root), **overrides}
    return EngineArgs(model=model, enable_routed_experts=True, **kwargs).create_engine_config()


def test_supported_config_selects_our_scheduler(tiny_model: str, shm_dir: Path) -> None:
    root = shm_dir / "store"  # does not exist yet: fine, its parent does
    vllm_config = build(tiny_model, root, artifact_capacity="1MiB")
    assert vllm_config.scheduler_config.async_scheduling is False
    assert vllm_config.scheduler_config.scheduler_cls == SYNC
    assert ArtifactConfig.from_vllm_config(vllm_config) == ArtifactConfig(
        enabled=True, root=root, capacity=2**20
    )
    assert not root.exists(), "startup checks must not create the store root"


def test_async_scheduling_selects_async_scheduler(tiny_model: str, shm_dir: Path) -> None:
    # vLLM's CPU platform forces async_scheduling off while it builds the config, so flip it
    # on the built config (what a GPU platform leaves) and run the same selection the hook runs.
    vllm_config = EngineArgs(model=tiny_model, **ENGINE_KWARGS).create_engine_config()
    vllm_config.scheduler_config.async_scheduling = True
    assert validation.set_scheduler_cls(vllm_config) == ASYNC
    assert vllm_config.scheduler_config.scheduler_cls == ASYNC


def test_r3_off_keeps_vllm_scheduler(tiny_model: str) -> None:
    vllm_config = EngineArgs(model=tiny_model, **ENGINE_KWARGS).create_engine_config()
    assert vllm_config.scheduler_config.scheduler_cls is None
    assert KEY not in vllm_config.additional_config


def test_user_scheduler_cls_conflicts(tiny_model: str, shm_dir: Path) -> None:
    with pytest.raises(ArtifactConfigError, match=r"needs vllm-artifact's scheduler.*my\.Sched"):
        build(tiny_model, shm_dir, scheduler_cls="my.Sched")


@pytest.mark.parametrize(
    "overrides, match",
    [
        # Our pre-check runs before vLLM's; without it vLLM 0.32 on CPU refuses PP=2 in its own
        # routed-experts check ("incompatible with pipeline parallelism (PP > 1)").
        (
            {"pipeline_parallel_size": 2},
            r"does not support pipeline parallelism \(--pipeline-parallel-size 2\).*"
            r"--tensor-parallel-size",
        ),
        # Without the pre-check vLLM fails first with "tp_size=1 must be divisible by dcp_size=2".
        (
            {"decode_context_parallel_size": 2},
            r"does not support context parallelism \(--decode-context-parallel-size 2",
        ),
        (
            {"prefill_context_parallel_size": 2},
            r"context parallelism .*--prefill-context-parallel-size 2\).*Set both to 1",
        ),
        (
            {"enable_prefix_caching": False},
            r"needs prefix caching.*--no-enable-prefix-caching",
        ),
    ],
)
def test_unsupported_parallelism_and_caching(
    tiny_model: str, shm_dir: Path, overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ArtifactConfigError, match=match):
        build(tiny_model, shm_dir, **overrides)


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_pd_roles_with_the_shared_storage_connector_supported(
    tiny_model: str, shm_dir: Path, role: str
) -> None:
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(shm_dir / "kv")},
    }
    vllm_config = build(tiny_model, shm_dir, kv_transfer_config=kv)
    assert vllm_config.kv_transfer_config.kv_role == role


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_pd_roles_with_a_cross_node_connector_rejected(
    tiny_model: str, shm_dir: Path, role: str
) -> None:
    kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": role}
    with pytest.raises(
        ArtifactConfigError,
        match=rf"LMCacheConnectorV1 \(kv_role='{role}'\): this connector moves KV between "
        r"engines on different nodes.*ExampleConnector.*kv_both",
    ):
        build(tiny_model, shm_dir, kv_transfer_config=kv)


def test_pd_roles_with_an_unverified_connector_rejected(tiny_model: str, shm_dir: Path) -> None:
    kv = {"kv_connector": "DecodeBenchConnector", "kv_role": "kv_consumer"}
    with pytest.raises(
        ArtifactConfigError, match=r"DecodeBenchConnector .*has not been verified.*ExampleConnector"
    ):
        build(tiny_model, shm_dir, kv_transfer_config=kv)


def test_cross_node_connector_named_by_vllm_rejected(tiny_model: str, shm_dir: Path) -> None:
    # kv_both passes our role check; vLLM's own check refuses NixlConnector by name and we
    # re-raise it with our message.
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    with pytest.raises(
        ArtifactConfigError, match=r"NixlConnector \(kv_role='kv_both'\): this connector moves KV"
    ):
        build(tiny_model, shm_dir, kv_transfer_config=kv)


def test_mooncake_master_that_does_not_answer_is_a_startup_error(
    tiny_model: str, shm_dir: Path
) -> None:
    with socket.socket() as unused:  # a loopback port nobody listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(
        ArtifactConfigError,
        match=rf"--artifact-mooncake-master 127.0.0.1:{port}: no Mooncake master answers there",
    ):
        build(
            tiny_model,
            shm_dir,
            artifact_backend="mooncake",
            artifact_mooncake_master=f"127.0.0.1:{port}",
        )
    assert time.monotonic() - started < 10  # not Mooncake's own 90-second wait


def test_kv_both_offload_connector_supported(tiny_model: str, shm_dir: Path) -> None:
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(shm_dir / "kv")},
    }
    vllm_config = build(tiny_model, shm_dir, kv_transfer_config=kv)
    assert vllm_config.kv_transfer_config.kv_role == "kv_both"


def test_dense_model_rejected(tiny_model: str, shm_dir: Path, tmp_path: Path) -> None:
    # The tiny model's config with zero experts: vLLM sees no MoE layer. Same architecture, so
    # vLLM needs no (slow) model-class inspection for a new one.
    dense = tmp_path / "dense"
    shutil.copytree(tiny_model, dense)
    config = json.loads((dense / "config.json").read_text())
    config["num_experts"] = 0
    (dense / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactConfigError, match="routed experts need a mixture-of-experts"):
        build(str(dense), shm_dir)


def test_root_outside_dev_shm_rejected(tiny_model: str, tmp_path: Path) -> None:
    with pytest.raises(ArtifactConfigError, match=r"--artifact-root: .*not under /dev/shm"):
        build(tiny_model, tmp_path)


def test_symlinked_root_rejected(tiny_model: str, shm_dir: Path) -> None:
    real = shm_dir / "real"
    real.mkdir(mode=0o700)
    (shm_dir / "link").symlink_to(real)
    with pytest.raises(ArtifactConfigError, match=r"--artifact-root: .*symlink"):
        build(tiny_model, shm_dir / "link")


def test_root_without_parent_rejected(tiny_model: str, shm_dir: Path) -> None:
    with pytest.raises(ArtifactConfigError, match=r"its parent directory .* does not exist"):
        build(tiny_model, shm_dir / "missing" / "store")


def test_capacity_larger_than_dev_shm_rejected(tiny_model: str, shm_dir: Path) -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    too_big = free + 2**40
    with pytest.raises(ArtifactConfigError) as info:
        build(tiny_model, shm_dir, artifact_capacity=too_big)
    message = str(info.value)
    assert "does not fit in /dev/shm" in message
    for fix in ("--shm-size", "--ipc=host", "smaller --artifact-capacity"):
        assert fix in message


def test_auto_capacity_skips_space_check(tiny_model: str, shm_dir: Path) -> None:
    vllm_config = build(tiny_model, shm_dir, artifact_capacity="auto")
    assert vllm_config.additional_config[KEY]["capacity"] == "auto"


def test_unrelated_vllm_errors_pass_through(tiny_model: str, shm_dir: Path) -> None:
    with pytest.raises(ValueError) as info:
        build(tiny_model, shm_dir, max_model_len=10**9)
    assert not isinstance(info.value, ArtifactConfigError)


def test_cpu_kv_offloading_accepted_and_counted_in_auto_capacity(
    tiny_model: str, shm_dir: Path
) -> None:
    """``--kv-offloading-size`` passes our startup checks (the CPU backend cannot run it:
    docs/compatibility.md), and ``auto`` capacity counts the blocks the offload can hold."""
    from vllm_artifact.integration.worker_connector import offloaded_kv_blocks

    vllm_config = build(tiny_model, shm_dir, kv_offloading_size=0.5)
    transfer = vllm_config.kv_transfer_config
    assert transfer.kv_role == "kv_both"
    assert transfer.kv_connector_extra_config["cpu_bytes_to_use"] == 0.5 * (1 << 30)
    # 64 blocks of 4 MiB in the KV cache: a 0.5 GiB offload holds 128 more.
    kv_cache = SimpleNamespace(num_blocks=64, kv_cache_tensors=[SimpleNamespace(size=64 << 22)])
    assert offloaded_kv_blocks(vllm_config, kv_cache) == 128
    assert offloaded_kv_blocks(build(tiny_model, shm_dir), kv_cache) == 0


def test_separate_draft_model_is_refused_with_the_alternatives(
    tiny_model: str, shm_dir: Path
) -> None:
    """vLLM 0.32 would die only when the worker loads the draft (its own routed-experts check
    refuses the draft's config); refused at startup instead, naming what works."""
    speculative = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 2}
    with pytest.raises(ArtifactConfigError, match="separate draft model") as err:
        build(tiny_model, shm_dir / "store", speculative_config=speculative)
    assert "'eagle', 'eagle3', 'mtp' or 'ngram'" in str(err.value)
