"""Every hook vllm-artifact installs into vLLM, in one place.

Each hook lives in its own module, replaces as little as possible, and checks at import time
(:func:`require`, a typed error) that the vLLM name it wraps still exists (so a vLLM upgrade
fails loudly at startup instead of silently skipping the hook). All hooks are applied by
:func:`apply_all`, which the ``vllm.general_plugins`` entry point calls in every vLLM process
(engine processes are spawned, so a patch made only in the parent would be lost).
``docs/vllm-hooks.md`` has the same table.

engine_args (``vllm.engine.arg_utils.EngineArgs``; checked against vLLM 0.32.0)
    Why: ``--enable-routed-experts``, the ``--artifact-*`` store options and their ``LLM(...)``
    keywords; startup checks must run before engine processes start.
    How: wraps ``add_cli_args`` (adds the flags), ``from_cli_args`` and ``__init__`` of
    ``EngineArgs``/``AsyncEngineArgs`` (map our options onto vLLM's
    ``enable_return_routed_experts`` plus ``additional_config["vllm_artifact"]``) and
    ``create_engine_config`` (startup refusals; selects our scheduler through vLLM's own
    ``scheduler_config.scheduler_cls``, which is configuration, not a patch).
    Future: a config-extension API upstream would make this unnecessary.

worker_factory (``vllm.v1.worker.gpu.model_runner.get_aux_output_connector``; vLLM 0.32.0)
    Why: Model Runner V2 must build our worker connector (rank-zero store, fail-closed reads)
    instead of vLLM's in-process one.
    How: replaces that module global with a factory of the same signature.
    Future: a connector registry upstream would replace this.

weight_version (``EngineCore.set_weight_version``, ``LLMEngine.set_weight_version``,
    ``AsyncLLM.update_weight_version`` and ``finish_weight_update``,
    ``RLOfflineMixin.finish_weight_update``; vLLM 0.32.0)
    Why: object keys must include the weight version, which vLLM keeps on the EngineCore only;
    vLLM accepts any string, ours must be one a key can carry.
    How: every setter checks the version first (a bad one raises ``WeightVersionError``: HTTP
    400, offline raised; the engine keeps its version); EngineCore's also tells our scheduler
    connector.

request_errors (``RequestState.make_request_output``, ``GenerateBaseServing._raise_if_error``;
    vLLM 0.32.0)
    Why: vLLM answers every errored request with HTTP 500 "Internal server error"; a request
    failed for R3 reasons must say why and what to do.
    How: our failures (finish reason ``error``, message in ``stop_reason``) are remembered by
    request id in the frontend and raise ``GenerationError`` (HTTP 500) with our message.

keys_handoff (``InputProcessor._validate_params``, ``CompletionRequest.to_sampling_params``,
    ``ChatCompletionRequest.to_sampling_params``; vLLM 0.32.0)
    Why: a request can ask for its R3 as store keys (``routed_experts_format="keys"``).
    How: the option is validated with vLLM's own parameter checks (HTTP 400, on the OpenAI
    server before a stream starts).

keys_answer (``AsyncLLM.generate``, ``OfflineInferenceMixin._run_engine``; vLLM 0.32.0)
    Why: a keys handle must resolve to exactly its request's rows: its last objects are
    published a step after the answer, a failed publication leaves them absent, and a key
    another request published first with other routing names that request's rows.
    How: before a finished output leaves the frontend, its handles are read back (waiting,
    bounded, for publication; the rows' digest checked); one that does not resolve fails its
    request closed.

terminal_output (``RequestState._new_completion_output``; ``vllm.utils.serial_utils.numpy2base64``
    and its copies in the completions, chat and token-in/token-out serving modules; module
    global ``JSONResponse`` of their API router modules; vLLM 0.32.0)
    Why: vLLM's encoding of a finished request's R3 (``np.save`` into a ``BytesIO``, then
    base64 and ``.decode``) makes three passes over many MiB, and Starlette's ``json.dumps``
    then scans every character of the base64 again (22-39 ms for 19 MiB); keys handles need
    their own form.
    How: the per-step chunks are concatenated into the data part of a complete ``.npy`` file
    and that file is base64-encoded straight to ``str`` (same text, no further copy); the
    handle our scheduler connector sends in vLLM's routed-experts transport becomes an
    ``R3Keys`` on the completion and its JSON text in the response; the routers' JSON
    response joins the base64 into the rendered text (same bytes). Serving and router
    modules are never imported by the hook (an import cycle vLLM may be in the middle of):
    ``numpy2base64`` is wrapped at its source, routers when they load (``after_import``).

early_import (``vllm.platform_plugins`` entry point; checked against vLLM 0.32.0)
    Why: ``LLM(enable_routed_experts=True)`` builds ``EngineArgs`` before vLLM loads general
    plugins, so the keyword would be rejected on the first call in a process.
    How: vLLM calls platform plugins while resolving ``current_platform``, which
    ``from vllm import LLM`` does before ``vllm.engine.arg_utils`` is imported; the hook (which
    never claims a platform) arranges for :func:`apply_all` to run right after that module
    loads. Not reached when ``VLLM_TARGET_DEVICE=cpu`` is set (vLLM then skips platform
    plugins); ``import vllm_artifact.integration.plugin`` before ``LLM(...)`` covers that case.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_artifact.errors import VllmIncompatibleError

_started = False
#: Set on every function a hook installs, so installing twice never wraps twice.
WRAPPED_MARK = "__vllm_artifact_wrapped__"


def require(condition: object, hook: str, what: str) -> None:
    """A hook's check of the vLLM it wraps, at install time: a typed error naming the hook
    (``assert`` would vanish under ``python -O``)."""
    if not condition:
        raise VllmIncompatibleError(
            f"{what}; vllm-artifact's {hook} hook was written for vLLM 0.32.0: install that "
            "version (pip install 'vllm==0.32.0') or a vllm-artifact release made for yours"
        )


def require_attributes(hook: str, *names: tuple[Any, str]) -> None:
    """:func:`require` that each ``(owner, name)`` exists."""
    for owner, name in names:
        label = str(getattr(owner, "__qualname__", None) or getattr(owner, "__name__", owner))
        module = getattr(owner, "__module__", None)
        where = f"{module}.{label}" if module and not label.startswith(module) else label
        require(hasattr(owner, name), hook, f"{where}.{name} is gone")


def wrap_once(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` (a class attribute or a module global) with ``make(current)``,
    unless a hook already did. ``make`` receives and returns the raw attribute, so static and
    class methods keep their descriptor."""
    current = owner.__dict__[name]
    if getattr(current, WRAPPED_MARK, False) or getattr(
        getattr(current, "__func__", None), WRAPPED_MARK, False
    ):
        return
    wrapped = make(current)
    setattr(getattr(wrapped, "__func__", wrapped), WRAPPED_MARK, True)
    setattr(owner, name, wrapped)


def apply_all() -> bool:
    """Install every hook once per process; returns True if this call installed them.

    Re-entrant calls return at once: importing a hook module imports vLLM modules, which can
    trigger the early-import hook (and so this function) before the first call has finished.
    """
    global _started
    if _started:
        return False
    _started = True
    from vllm_artifact.integration.hooks import (
        engine_args,
        keys_answer,
        keys_handoff,
        request_errors,
        terminal_output,
        weight_version,
        worker_factory,
    )

    engine_args.install()
    worker_factory.install()
    weight_version.install()
    request_errors.install()
    keys_handoff.install()
    keys_answer.install()
    terminal_output.install()
    return True
