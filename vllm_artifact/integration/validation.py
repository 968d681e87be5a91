"""Startup checks for routed-experts output, and the one config change R3 needs.

Everything here runs in the frontend process from the ``create_engine_config`` hook, before
any engine process starts, and only with R3 on. Each refusal is an
:class:`~vllm_artifact.errors.ArtifactConfigError` whose message says what is wrong, why it
cannot work, and which flag or variable to change.

Order (see ``hooks/engine_args.py``): :func:`check_engine_args` looks at the raw arguments so
our message wins over vLLM's own, terser checks; vLLM builds its ``VllmConfig``;
:func:`translate_upstream_error` rewords vLLM's routed-experts refusals we know;
:func:`check_vllm_config` checks the built config (the authority: vLLM may derive fields,
e.g. a KV transfer config from ``--kv-offloading-size``) and the store root on disk;
:func:`set_scheduler_cls` selects our scheduler.
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import stat
from typing import Any

from vllm_artifact.core.store import check_root, check_shm_space
from vllm_artifact.errors import (
    ArtifactConfigError,
    ShmSpaceError,
    StoreNotFoundError,
    UnsafeRootError,
)
from vllm_artifact.integration.config import ArtifactConfig
from vllm_artifact.integration.hooks.versions import check_supported
from vllm_artifact.integration.kv_transfer_rules import check_kv_transfer, cross_node_message

__all__ = [
    "ASYNC_SCHEDULER_CLS",
    "SCHEDULER_CLS",
    "check_before_config",
    "check_engine_args",
    "check_vllm_config",
    "set_scheduler_cls",
    "translate_upstream_error",
]

SCHEDULER_CLS = "vllm_artifact.integration.scheduler.ArtifactScheduler"
ASYNC_SCHEDULER_CLS = "vllm_artifact.integration.scheduler.ArtifactAsyncScheduler"
_OUR_SCHEDULERS = frozenset({SCHEDULER_CLS, ASYNC_SCHEDULER_CLS})

# ------------------------------------------------------------------------------- messages

_MRV1 = (
    "--enable-routed-experts needs vLLM's Model Runner V2 (routed experts are captured "
    "there), but VLLM_USE_V2_MODEL_RUNNER=0 selects Model Runner V1. Unset "
    "VLLM_USE_V2_MODEL_RUNNER or set it to 1."
)
_PP = (
    "--enable-routed-experts does not support pipeline parallelism "
    "(--pipeline-parallel-size {size}): the MoE layers would be split across pipeline stages, "
    "while one rank must capture every layer's routing and own the R3 store. Use tensor "
    "parallelism (--tensor-parallel-size) instead, or set --pipeline-parallel-size 1."
)
_CP = (
    "--enable-routed-experts does not support context parallelism "
    "(--decode-context-parallel-size {dcp}, --prefill-context-parallel-size {pcp}): a "
    "request's tokens would be split across ranks, so no rank sees its full routing. Set "
    "both to 1."
)
_NOT_MOE = (
    "--enable-routed-experts: routed experts need a mixture-of-experts model, but {model!r} "
    "has no MoE layer (num_experts={experts}). Drop --enable-routed-experts for dense models."
)
_NO_PREFIX_CACHING = (
    "--enable-routed-experts needs prefix caching (R3 objects are keyed by the prefix-cache "
    "block hashes): remove --no-enable-prefix-caching (LLM keyword "
    "enable_prefix_caching=False)."
)
_NOT_GENERATE = (
    "--enable-routed-experts only works with generative models (--runner generate); pooling "
    "and other runners sample no tokens to route."
)
_ADAPTIVE_SPEC = (
    "--enable-routed-experts does not support adaptive speculative verification: drop "
    "enable_adaptive_verification from --speculative-config."
)
_DRAFT_MODEL = (
    "--enable-routed-experts cannot run speculative decoding with a separate draft model "
    "(--speculative-config method 'draft_model') on vLLM 0.32: vLLM copies the routed-experts "
    "setting into the draft model's config, whose runner is 'draft', and refuses it while the "
    "worker loads the draft. Use 'eagle', 'eagle3', 'mtp' or 'ngram' speculative decoding, or "
    "drop --enable-routed-experts."
)
_SCHEDULER = (
    "--enable-routed-experts needs vllm-artifact's scheduler (it swaps vLLM's in-process "
    "routed-experts store for the durable /dev/shm store and fails bad requests without "
    "stopping the engine), but --scheduler-cls {cls!r} is set. Remove --scheduler-cls "
    "(LLM keyword scheduler_cls)."
)

#: vLLM 0.32's own routed-experts refusals (``VllmConfig._verify_aux_output_compatibility``)
#: that we reword; matched by substring because vLLM raises plain ``ValueError``s.
_UPSTREAM = (
    ("AuxOutput Connector requires Model Runner V2", _MRV1),
    ("AuxOutput Connector only supports generate runners", _NOT_GENERATE),
    ("AuxOutput Connector requires prefix caching", _NO_PREFIX_CACHING),
    ("adaptive speculative verification", _ADAPTIVE_SPEC),
)
_UPSTREAM_MOE = "AuxOutput Connector only supports MoE models"
_UPSTREAM_PP = "incompatible with pipeline parallelism"
_UPSTREAM_CP = "incompatible with context parallelism"
_UPSTREAM_PD = re.compile(r"incompatible with (\w+); PD auxiliary output is not supported")


# ---------------------------------------------------------------------- before the config


def check_before_config(*, enabled: bool) -> None:
    """Checks that need only the environment (run before vLLM builds its config): the vLLM
    version first (``VllmIncompatibleError`` naming the supported range), then the model
    runner."""
    if not enabled:
        return
    check_supported()
    import vllm.envs as envs

    # vLLM 0.34 has only Model Runner V2 (and refuses the variable set to 0 itself).
    if getattr(envs, "VLLM_USE_V2_MODEL_RUNNER", None) is False:
        raise ArtifactConfigError(_MRV1)


def check_engine_args(engine_args: Any) -> None:
    """Refuse what the raw ``EngineArgs`` already show, before vLLM's own checks run.

    vLLM rejects several of these itself, but later and in its own words (or, for context
    parallelism, with an unrelated divisibility error); checking first makes our message win.
    """
    check_before_config(enabled=True)
    _check_parallelism(
        engine_args.pipeline_parallel_size,
        engine_args.decode_context_parallel_size,
        engine_args.prefill_context_parallel_size,
    )
    check_kv_transfer(engine_args.kv_transfer_config)
    if engine_args.enable_prefix_caching is False:
        raise ArtifactConfigError(_NO_PREFIX_CACHING)
    _check_user_scheduler(engine_args.scheduler_cls)


def translate_upstream_error(err: ValueError, engine_args: Any) -> ArtifactConfigError | None:
    """Our message for a routed-experts refusal raised by vLLM, or None if it is not one."""
    text = str(err)
    for needle, message in _UPSTREAM:
        if needle in text:
            return ArtifactConfigError(message)
    if _UPSTREAM_MOE in text:
        return ArtifactConfigError(_NOT_MOE.format(model=engine_args.model, experts=0))
    if _UPSTREAM_PP in text:
        return ArtifactConfigError(_PP.format(size=engine_args.pipeline_parallel_size))
    if _UPSTREAM_CP in text:
        return ArtifactConfigError(
            _CP.format(
                dcp=engine_args.decode_context_parallel_size,
                pcp=engine_args.prefill_context_parallel_size,
            )
        )
    if match := _UPSTREAM_PD.search(text):
        (role,) = _fields(engine_args.kv_transfer_config or {}, "kv_role")
        return ArtifactConfigError(cross_node_message(match.group(1), str(role)))
    return None


# ----------------------------------------------------------------------- after the config


def check_vllm_config(vllm_config: Any) -> ArtifactConfig:
    """Refuse unsupported configurations in the built ``VllmConfig``; returns our settings.

    The store checks look at the filesystem: the root must be (or be creatable as) a private
    directory under /dev/shm, and /dev/shm must have room for an explicit capacity on every
    local DP rank. With ``capacity="auto"`` the size depends on the KV cache, which only the
    worker knows; it checks then.
    """
    parallel = vllm_config.parallel_config
    _check_parallelism(
        parallel.pipeline_parallel_size,
        parallel.decode_context_parallel_size,
        parallel.prefill_context_parallel_size,
    )
    check_kv_transfer(vllm_config.kv_transfer_config)
    speculative = vllm_config.speculative_config
    if speculative is not None and speculative.uses_draft_model():
        raise ArtifactConfigError(_DRAFT_MODEL)
    model_config = vllm_config.model_config
    experts = model_config.get_num_experts()
    if not model_config.is_moe or experts <= 0:
        raise ArtifactConfigError(_NOT_MOE.format(model=model_config.model, experts=experts))
    config = ArtifactConfig.from_vllm_config(vllm_config)
    check_store_root(config)  # with Mooncake too: the engine's metrics file lives there
    if config.backend == "mooncake":
        check_mooncake(config)
        return config
    if config.capacity != "auto":
        engines = max(1, parallel.data_parallel_size_local)
        check_store_space(config, config.capacity * engines, engines=engines)
    return config


def check_mooncake(config: ArtifactConfig, *, timeout: float = 3.0) -> None:
    """Backend ``mooncake``: the client library is installed and the master answers.

    Mooncake's own client waits about 90 s for a master that is not there; a TCP connect to
    its RPC port answers in ``timeout`` seconds at most, so a wrong address is a startup error
    that names it.
    """
    if importlib.util.find_spec("mooncake") is None:
        raise ArtifactConfigError(
            "--artifact-backend mooncake needs Mooncake's client: pip install "
            "'vllm-artifact[mooncake]' (and the system library libibverbs.so.1: apt-get "
            "install libibverbs1), or use --artifact-backend shm."
        )
    master = str(config.mooncake_master)
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise ArtifactConfigError(
            f"--artifact-mooncake-master {master}: no Mooncake master answers there ({err}). "
            "Start mooncake_master (--rpc_port) on that address first, or fix the address."
        ) from None


def check_store_root(config: ArtifactConfig) -> None:
    """The root must be a safe directory under /dev/shm, or creatable as one.

    Uses the store's own check (no symlinks, owned by us, not writable by others, root mode
    0700) without creating anything: the engine's store creates the root later. A root that
    does not exist yet is fine if its parent does (the store creates only the last level).
    """
    root = str(config.root)
    try:
        check_root(root, create=False)
    except UnsafeRootError as err:
        raise ArtifactConfigError(f"--artifact-root: {err}") from None
    except StoreNotFoundError:
        parent = os.path.dirname(root)
        if not os.path.isdir(parent):
            raise ArtifactConfigError(
                f"--artifact-root {root!r}: its parent directory {parent!r} does not exist. "
                "Create it, or use a root directly under /dev/shm (for example "
                "--artifact-root /dev/shm/vllm-artifact-rl)."
            ) from None


def check_store_space(config: ArtifactConfig, needed_bytes: int, *, engines: int) -> None:
    """/dev/shm must have room for ``needed_bytes`` (an explicit capacity on every local rank).

    Bytes already used under the root count as free: after a restart the engine reuses or
    replaces its own store. That over-counts when another live engine shares the root; the
    worker's exact check still catches that case before the store grows.
    """
    try:
        check_shm_space(config.root, needed_bytes, reclaimable_bytes=_bytes_under(config.root))
    except ShmSpaceError as err:
        raise ArtifactConfigError(
            f"--artifact-capacity {_mib(config.capacity)} x {engines} local engine(s) does "
            f"not fit in /dev/shm: {err}"
        ) from None


def _mib(capacity: int | str) -> str:
    return capacity if isinstance(capacity, str) else f"{capacity / 2**20:.0f}MiB"


def _bytes_under(root: os.PathLike[str]) -> int:
    """Bytes allocated by our own regular files below ``root`` (symlinks not followed)."""
    total = 0
    uid = os.geteuid()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                total += st.st_blocks * 512
    return total


# -------------------------------------------------------------------------------- scheduler


def set_scheduler_cls(vllm_config: Any) -> str:
    """Select vllm-artifact's scheduler (async or not, as vLLM decided); returns its name.

    The scheduler subclass builds our scheduler-side connector in place of vLLM's own
    routed-experts connector; ``SchedulerConfig.scheduler_cls`` takes a qualname, resolved
    in the EngineCore process, so nothing is imported here. A scheduler the user chose
    cannot be combined with ours.
    """
    scheduler_config = vllm_config.scheduler_config
    _check_user_scheduler(scheduler_config.scheduler_cls)
    name = ASYNC_SCHEDULER_CLS if scheduler_config.async_scheduling else SCHEDULER_CLS
    scheduler_config.scheduler_cls = name
    return name


# ---------------------------------------------------------------------------------- helpers


def _check_parallelism(pp: int | None, dcp: int | None, pcp: int | None) -> None:
    if (pp or 1) > 1:
        raise ArtifactConfigError(_PP.format(size=pp))
    if (dcp or 1) > 1 or (pcp or 1) > 1:
        raise ArtifactConfigError(_CP.format(dcp=dcp or 1, pcp=pcp or 1))


def _check_user_scheduler(scheduler_cls: Any) -> None:
    if scheduler_cls is None or scheduler_cls in _OUR_SCHEDULERS:
        return
    name = scheduler_cls if isinstance(scheduler_cls, str) else _qualname(scheduler_cls)
    raise ArtifactConfigError(_SCHEDULER.format(cls=name))


def _fields(obj: Any, *names: str) -> tuple[Any, ...]:
    """Fields of a vLLM config object or of the dict a user passed instead."""
    if isinstance(obj, dict):
        return tuple(obj.get(name) for name in names)
    return tuple(getattr(obj, name, None) for name in names)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
