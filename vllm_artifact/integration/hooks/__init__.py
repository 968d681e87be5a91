"""Every place vllm-artifact touches vLLM, in one registry: :data:`PATCHES`.

Each entry names the vLLM names (``targets``), what we do to them (``kind``), which module of
ours does it (``hook``), and why, how, the upstream status and the plan for removing it. The
registry is data: ``tests/integration/test_patch_registry.py`` compares it with what the
plugin really installs (:data:`~vllm_artifact.integration.hooks.patching.INSTALLED`), with
our subclasses' overrides and with the private vLLM names our code uses, so an entry cannot
go missing or stay after its patch is gone.

Rules: patch only what no configuration or plugin API reaches; every wrap calls the original
and passes through unchanged with R3 off; every patched name is checked when the hook is
installed (:func:`require`, a typed error, so a vLLM upgrade fails at startup instead of
silently skipping a hook). The supported vLLM versions are declared once, in the package
metadata (``hooks/versions.py``); on any other version only the ``engine_args`` hook is
installed, which refuses R3 with the supported range.

:func:`apply_all` installs the hooks; vLLM calls it in every process through the
``vllm.general_plugins`` entry point (``plugin.register``; engine processes are spawned, so a
patch made only in the parent would be lost).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

from vllm_artifact.errors import VllmIncompatibleError
from vllm_artifact.integration.hooks.patching import (
    INSTALLED,
    WRAPPED_MARK,
    require,
    require_attributes,
    wrap_once,
)
from vllm_artifact.integration.hooks.versions import SERIES

__all__ = [
    "INSTALLED",
    "PATCHES",
    "WRAPPED_MARK",
    "Kind",
    "Patch",
    "apply_all",
    "require",
    "require_attributes",
    "wrap_once",
]

logger = logging.getLogger("vllm.artifact")


class Kind(StrEnum):
    WRAP = "wrap"  # replaced (wrap_once) by ours, which calls or extends the original
    REPLACE = "replace"  # replaced (wrap_once) by ours; the original never runs
    OVERRIDE = "override"  # a method of a vLLM class that our subclass overrides
    INSTANCE = "instance"  # an attribute of one vLLM object, changed at runtime
    PRIVATE = "private"  # a vLLM internal we read or call as it is
    CARRIES = "carries"  # a vLLM field that carries a value of our type
    ENTRY_POINT = "entry_point"  # a vLLM plugin entry-point group we register in


@dataclass(frozen=True)
class Patch:
    hook: str  # our module that does it (vllm_artifact/integration/**/<hook>.py)
    kind: Kind
    targets: tuple[str, ...]  # dotted names in vLLM (entry points: the group)
    why: str
    how: str
    upstream: str  # a vLLM issue or pull request, or why there is none
    removal: str
    series: tuple[str, ...] = SERIES  # the vLLM release series whose targets these are


_ARGS = "vllm.engine.arg_utils"
_ASYNC_LLM = "vllm.v1.engine.async_llm.AsyncLLM"
_STATE = "vllm.v1.engine.output_processor.RequestState"
_CONNECTOR = "vllm.distributed.aux_output_connector.connector.AuxOutputSchedulerConnector"
_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
_OPENAI = "vllm.entrypoints.openai"
_TITO = "vllm.entrypoints.scale_out.token_in_token_out"
_FRONTENDS = (f"{_OPENAI}.completion", f"{_OPENAI}.chat_completion", _TITO)

PATCHES: tuple[Patch, ...] = (
    Patch(
        hook="engine_args",
        kind=Kind.WRAP,
        targets=(
            f"{_ARGS}.EngineArgs.add_cli_args",
            f"{_ARGS}.EngineArgs.from_cli_args",
            f"{_ARGS}.EngineArgs.__init__",
            f"{_ARGS}.AsyncEngineArgs.__init__",
            f"{_ARGS}.EngineArgs.create_engine_config",
        ),
        why="--enable-routed-experts, the --artifact-* store options and their LLM(...) "
        "keywords must exist on vLLM's own parser and EngineArgs; startup refusals (the "
        "vLLM version first) must run in the frontend before any engine process starts.",
        how="Each wrapper calls the original. add_cli_args adds our argument group; "
        "from_cli_args and __init__ map our options onto enable_return_routed_experts and "
        'additional_config["vllm_artifact"] (options.py); create_engine_config runs the '
        "startup checks (validation.py), on vLLM 0.34 turns lookahead block hashes off for "
        "speculative decoding unless the user chose (seams.prepare_engine_args: a finished "
        "request's last blocks would have no key), selects our scheduler through vLLM's "
        "scheduler_config.scheduler_cls and registers the store metrics. With R3 off and "
        "none of our options the arguments reach vLLM unchanged.",
        upstream="None found: vLLM has no plugin API for CLI options or keywords; the "
        "closest is vllm-project/vllm#18179 (OpenAI server plugins, a prototype, open).",
        removal="An option-and-validation hook for general plugins upstream; until then the "
        "wraps stay thin (the logic is in options.py and validation.py).",
    ),
    Patch(
        hook="validation",
        kind=Kind.PRIVATE,
        targets=("vllm.config.vllm.VllmConfig._verify_aux_output_compatibility",),
        why="vLLM's own routed-experts refusals are plain ValueErrors in its words; ours "
        "say which flag to change.",
        how="translate_upstream_error matches their message text; a message that changed "
        "reaches the user as vLLM wrote it.",
        upstream="None: vLLM raises untyped ValueErrors for configuration conflicts.",
        removal="Drop the rewording once vLLM's messages name the flag to change.",
    ),
    Patch(
        hook="worker_factory",
        kind=Kind.REPLACE,
        targets=("vllm.v1.worker.gpu.model_runner.get_aux_output_connector",),
        why="Model Runner V2 must build our worker connector (capture on every TP rank, "
        "rank-zero buffer, /dev/shm store, background publisher, fail-closed prefix reads) "
        "instead of vLLM's in-process AuxOutput worker connector.",
        how="The module global that GPUModelRunner.initialize_kv_cache calls (after KV "
        "sizing, before warm-up, with routed experts on) becomes a factory of the same "
        "signature (checked at install) that returns ArtifactWorkerConnector, which binds "
        "vLLM's routed-experts capture to the model through our subclass of "
        "RoutedExpertsCapturer (below).",
        upstream="vllm-project/vllm#45635 (merged) added the AuxOutput connector with one "
        "built-in backend; no setting names an out-of-tree connector class.",
        removal="A connector-class setting upstream (as KV connectors have) makes this "
        "configuration.",
    ),
    Patch(
        hook="capture",
        kind=Kind.OVERRIDE,
        targets=(
            "vllm.model_executor.layers.fused_moe.routed_experts_capturer."
            "RoutedExpertsCapturer.capture",
            "vllm.model_executor.layers.fused_moe.routed_experts_capturer."
            "RoutedExpertsCapturer.snapshot_routing_data",
        ),
        why="vLLM's capture copies each MoE layer's top-k ids into its device buffer as the "
        "layer runs: free inside a CUDA graph, but in an eager step one copy launch per MoE "
        "layer on the engine's main thread, which eager steps wait for.",
        how="BatchedEagerCapturer (capture.py): outside graph capture, without data or "
        "expert parallelism or EPLB, capture keeps a reference to the layer's top-k ids and "
        "snapshot_routing_data joins them with one stack; otherwise, and after a graph "
        "replay, both run vLLM's. A step whose captures do not add up fails its requests.",
        upstream="None yet: worth proposing to vLLM (its own connector pays the same "
        "per-layer copies in eager steps).",
        removal="Drop the subclass once vLLM's capturer batches eager steps itself.",
    ),
    Patch(
        hook="scheduler",
        kind=Kind.OVERRIDE,
        targets=(
            f"{_SCHEDULER}.__init__",
            f"{_SCHEDULER}.update_from_output",
            "vllm.v1.core.sched.async_scheduler.AsyncScheduler.__init__",
        ),
        why="The scheduler must build our scheduler connector, and a request whose R3 "
        "cannot be delivered completely must finish with an error before vLLM processes "
        "the step (never answered with partial R3) while the engine serves the rest.",
        how="ArtifactScheduler and ArtifactAsyncScheduler (scheduler.py), selected through "
        "vLLM's SchedulerConfig.scheduler_cls (configuration, set by "
        "validation.set_scheduler_cls): __init__ swaps in our connector; update_from_output "
        "finishes failed requests with FINISHED_ERROR, then runs vLLM's.",
        upstream="None found: vLLM's connector output has no per-request failure path (a "
        "worker error trips an assertion that kills the engine).",
        removal="Connector-reported request failures and a connector-class setting upstream.",
    ),
    Patch(
        hook="scheduler",
        kind=Kind.INSTANCE,
        targets=(
            "vllm.v1.core.block_pool.BlockPool._emit_block_removed_events",
            "vllm.v1.core.block_pool.BlockPool.reset_prefix_cache",
        ),
        why="The worker unpins a store object once no KV block can hit it, which only the "
        "block pool's evictions (and prefix-cache resets) tell.",
        how="On its own scheduler's block pool instance (both checked to exist): wraps the "
        "private method every eviction path reports removed block hashes through, and "
        "reset_prefix_cache; each calls the original, so vLLM's KV events stay as the user "
        "configured them. Turning the pool's events on instead would build a BlockStored "
        "event for every block cached.",
        upstream="None found: evictions reach only vLLM's KV events, which go to its ZMQ "
        "publisher and carry every stored block too.",
        removal="An in-process eviction callback (or removals-only KV event subscription) "
        "upstream.",
    ),
    Patch(
        hook="scheduler_connector",
        kind=Kind.OVERRIDE,
        targets=(
            f"{_CONNECTOR}.__init__",
            f"{_CONNECTOR}.request_finished",
            f"{_CONNECTOR}.build_connector_meta",
            f"{_CONNECTOR}.take_output",
        ),
        why="vLLM's transport (block-hash shipping, emit cursors) is reused, but each step "
        "must also carry the weight version, terminal partial-block hashes, KV evictions "
        "and key leases, and a keys-only request gets a handle instead of rows.",
        how="ArtifactSchedulerConnector subclasses it: build_connector_meta wraps vLLM's "
        "metadata in ArtifactStepMetadata (emit starts only for requests the worker has not "
        "seen, and the room for a held request's first rows, from Request.max_tokens); "
        "take_output reads our column-wise StepResult and never raises into vLLM; "
        "request_finished also hashes the tail block; __init__ checks the private state "
        "below.",
        upstream="vllm-project/vllm#45635 (merged) introduced the connector; "
        "vllm-project/vllm#58150 (merged) narrowed its KV-connector restrictions; none adds "
        "extension points.",
        removal="Per-step metadata extension and failure reporting in the connector API.",
    ),
    Patch(
        hook="scheduler_connector",
        kind=Kind.PRIVATE,
        targets=(
            f"{_CONNECTOR}._sent_hash_counts",
            f"{_CONNECTOR}._finished_requests",
            f"{_CONNECTOR}._generation",
        ),
        why="Our build_connector_meta replaces vLLM's and must keep its bookkeeping as "
        "vLLM's does, so the inherited reset (and, on 0.32, request_finished) stay right.",
        how="Read and updated as vLLM's own method does; their types are checked when the "
        "connector is built (VllmIncompatibleError).",
        upstream="None: vLLM's internals.",
        removal="Goes with the build_connector_meta override.",
    ),
    Patch(
        hook="vllm032",
        kind=Kind.OVERRIDE,
        targets=(f"{_CONNECTOR}.__init__",),
        why="Both series' connectors are built with (kv_cache_manager, kv_connector), as "
        "vLLM 0.34 builds its own; 0.32's takes no arguments.",
        how="SchedulerConnectorBase in seams/vllm032.py drops them and checks the packer.",
        upstream="None: the constructor changed in vLLM 0.33.",
        removal="Goes with vLLM 0.32 support.",
        series=("0.32",),
    ),
    Patch(
        hook="vllm032",
        kind=Kind.PRIVATE,
        targets=(f"{_CONNECTOR}._pack_new_hashes",),
        why="Block hashes are packed for the worker the way vLLM packs them.",
        how="seams/vllm032.py calls it (checked callable when the connector is built).",
        upstream="None: vLLM's internals.",
        removal="Goes with the build_connector_meta override.",
        series=("0.32",),
    ),
    Patch(
        hook="vllm034",
        kind=Kind.PRIVATE,
        targets=(
            f"{_CONNECTOR}._pack_hashes",
            f"{_CONNECTOR}._sent_hash_counts",
            f"{_CONNECTOR}._finished_requests",
        ),
        why="vLLM 0.34 renamed the hash packer; the 0.32-style request_finished below "
        "keeps the bookkeeping build_connector_meta reads.",
        how="seams/vllm034.py calls _pack_hashes (checked callable when the connector is "
        "built) and updates the two dicts as vLLM 0.32's request_finished did.",
        upstream="None: vLLM's internals.",
        removal="Goes with the build_connector_meta override.",
        series=("0.34",),
    ),
    Patch(
        hook="vllm034",
        kind=Kind.OVERRIDE,
        targets=(
            f"{_CONNECTOR}.__init__",
            f"{_CONNECTOR}.request_finished",
            f"{_CONNECTOR}.max_cache_hit",
            f"{_CONNECTOR}.cap_external_hit",
            f"{_CONNECTOR}.request_loading",
        ),
        why="vLLM 0.34 caps every prefix hit to the blocks its own in-process R3 store "
        "retains (and drops a KV connector's hit it cannot vouch for). Our R3 lives in "
        "another store, shared by the node's engines and restarts, and our contract keeps the "
        "KV cache authoritative: a hit is never shortened, a missing object fails that "
        "request closed.",
        how="SchedulerConnectorBase in seams/vllm034.py (its __init__ passes vLLM 0.34's "
        "constructor arguments on): max_cache_hit returns None (vLLM's "
        "default limit), cap_external_hit keeps the connector's hit, request_loading does "
        "nothing; its request_finished is vLLM 0.32's (no retained/released bookkeeping).",
        upstream="vLLM 0.33 introduced the cap (AuxOutputSchedulerConnector.max_cache_hit); "
        "no setting turns it off.",
        removal="A connector-class setting upstream, or a cap that asks the configured store.",
        series=("0.34",),
    ),
    Patch(
        hook="vllm_contract",
        kind=Kind.OVERRIDE,
        targets=(
            "vllm.distributed.aux_output_connector.connector.AuxOutputConnectorMetadata.__init__",
        ),
        why="Each step's metadata must carry our fields (weight version, tail hashes, KV "
        "evictions, key leases) and still be the type vLLM declares for "
        "build_connector_meta.",
        how="ArtifactStepMetadata is a dataclass subclass of vLLM's metadata and of "
        "vllm_artifact.contract.ArtifactStepFields: vLLM's fields stay positional and first, "
        "ours are keywords with defaults (the generated __init__ replaces vLLM's).",
        upstream="None found: the metadata has no extension field.",
        removal="An extension field on the connector metadata upstream.",
    ),
    Patch(
        hook="vllm_contract",
        kind=Kind.CARRIES,
        targets=(
            "vllm.v1.core.sched.output.SchedulerOutput.aux_output_connector_metadata",
            "vllm.v1.outputs.ModelRunnerOutput.aux_output_connector_output",
            "vllm.v1.engine.EngineCoreOutput.routed_experts",
        ),
        why="Our scheduler and worker connectors exchange more than vLLM's types hold.",
        how="ArtifactStepMetadata and StepResult ride in vLLM's connector fields, pickled "
        "across processes and read only by our connectors (vLLM types the output as a dict "
        "of AuxRequestOutput: its Ray executor iterates it and is not supported). A "
        "keys-only request's terminal output carries a [1, n] uint8 array (R3 rows are "
        "3-D) that terminal_output turns into an R3Keys; a held request's first rows may "
        "travel as a 1-D uint8 .npy file with room behind them (core/row_file.py), which "
        "terminal_output's ArrivingRows adopts and lists as their rows.",
        upstream="None: the fields are typed for vLLM's own connector.",
        removal="Typed extension fields upstream.",
    ),
    Patch(
        hook="weight_version",
        kind=Kind.WRAP,
        targets=(
            "vllm.v1.engine.core.EngineCore.set_weight_version",
            "vllm.v1.engine.llm_engine.LLMEngine.set_weight_version",
            f"{_ASYNC_LLM}.update_weight_version",
            f"{_ASYNC_LLM}.finish_weight_update",
            "vllm.entrypoints.rl.offline.RLOfflineMixin.finish_weight_update",
        ),
        why="Object keys include the weight version, which vLLM keeps only on the "
        "EngineCore and accepts as any string; one keys cannot carry (empty, over 4096 "
        "characters, invalid Unicode) would kill the engine at its next step.",
        how="Every setter checks the version first (WeightVersionError: HTTP 400; the "
        "engine keeps its version); EngineCore's then tells our scheduler connector, which "
        "ships it with each step. Frontend setters are patched when vLLM loads their module.",
        upstream="vllm-project/vllm#49040 (merged) added the weight-version API; "
        "vllm-project/vllm#54443 (RFC, open) proposes per-request attribution.",
        removal="The EngineCore wrap goes once vLLM hands the version to connectors; the "
        "checks stay while vLLM accepts any string.",
    ),
    Patch(
        hook="request_errors",
        kind=Kind.WRAP,
        targets=(
            f"{_STATE}.make_request_output",
            "vllm.entrypoints.generate.base.serving.GenerateBaseServing._raise_if_error",
        ),
        why='vLLM answers every errored request with HTTP 500 "Internal server error"; a '
        "request failed for R3 reasons must say why and what to do.",
        how="Our failures (finish reason error, message in stop_reason) are remembered by "
        "request id in the frontend and counted by reason; _raise_if_error raises vLLM's "
        "GenerationError with our message.",
        upstream="vllm-project/vllm#37148 (merged) maps FINISHED_ERROR to GenerationError "
        "with a generic message; none carries the reason.",
        removal="An error message on FINISHED_ERROR outputs upstream.",
    ),
    Patch(
        hook="keys_handoff",
        kind=Kind.WRAP,
        targets=(
            "vllm.v1.engine.input_processor.InputProcessor._validate_params",
            f"{_OPENAI}.completion.protocol.CompletionRequest.to_sampling_params",
            f"{_OPENAI}.chat_completion.protocol.ChatCompletionRequest.to_sampling_params",
        ),
        why='A request may ask for its R3 as store keys (routed_experts_format="keys" in '
        "extra_args / vllm_xargs); a bad value must be refused before the request reaches "
        "the engine and before a stream starts.",
        how="The option is checked where vLLM checks its own sampling parameters "
        "(VLLMValidationError: HTTP 400).",
        upstream="vllm-project/vllm#16862 (merged) passes vllm_xargs into extra_args; "
        "vllm-project/vllm#17191 (RFC, open) proposes validating them against a declared "
        "model.",
        removal="A declared, validated extra-args schema upstream.",
    ),
    Patch(
        hook="keys_answer",
        kind=Kind.WRAP,
        targets=(
            f"{_ASYNC_LLM}.generate",
            "vllm.entrypoints.common.offline.OfflineInferenceMixin._run_engine",
            "vllm.v1.engine.llm_engine.LLMEngine.step",
        ),
        why="A keys handle must resolve to exactly its request's rows: its last objects "
        "are published a step after the answer, a failed publication leaves them absent, "
        "and a key another request published first names that request's rows.",
        how="Before a finished output leaves the frontend its handles are checked (bounded "
        "wait; the objects' envelope checksums against the handle's objects digest, or a "
        "read back of every object where that cannot tell; on the server in a worker "
        "thread); one that does not resolve fails its request closed. Offline, "
        "LLMEngine.step checks, during an _run_engine call only, the handles of earlier "
        "steps whose objects are published, so a batch's end checks only its last steps'. "
        "Patched when vLLM loads their module.",
        upstream="None: the keys handoff is ours.",
        removal="A connector hook that runs before a finished output is returned.",
    ),
    Patch(
        hook="keys_answer",
        kind=Kind.PRIVATE,
        targets=("vllm.v1.engine.core_client.InprocClient",),
        why="An in-process engine core publishes a finished request's tail only in its next step.",
        how="Recognised by its class name on llm_engine.engine_core and stepped once "
        "before the handles are read.",
        upstream="None: a detail of our keys handoff.",
        removal="Goes with the _run_engine wrap.",
    ),
    Patch(
        hook="terminal_output",
        kind=Kind.WRAP,
        targets=(
            f"{_STATE}.__init__",
            f"{_STATE}._new_completion_output",
            "vllm.utils.serial_utils.numpy2base64",
            *(f"{frontend}.serving.numpy2base64" for frontend in _FRONTENDS),
            *(f"{frontend}.api_router.JSONResponse" for frontend in _FRONTENDS),
        ),
        why="vLLM encodes a finished request's R3 with np.save into a BytesIO, then base64 "
        "and decode (three passes over many MiB), and Starlette's json.dumps scans the "
        "base64 again (22-39 ms for 19 MiB); keys handles need their own form. vLLM "
        "concatenates a request's chunks at its end, when many requests finish together on "
        "the frontend's one output thread (the round's tail, the engine idle).",
        how="RequestState's chunk list becomes an ArrivingRows (core/row_assembly.py) that "
        "copies each chunk on arrival into the data part of a complete .npy (memory of the "
        "frontend's file pool, used again once earlier rows are dropped), or adopts a first "
        "chunk the engine sent as such a file with room for the rest (core/row_file.py) "
        "and copies only the later rows; at the end "
        "that file is used, or the chunks are concatenated into one, "
        "base64-encoded straight to str (the same text); the routers' JSON response joins "
        "that text into the rendered JSON (the same bytes); a transported keys handle "
        "becomes an R3Keys and its JSON text. Serving and router modules are patched when "
        "vLLM loads them (hooks/after_import.py), never imported by the hook.",
        upstream="vllm-project/vllm#33548 (merged) uses ORJSONResponse for embeddings; none "
        "for R3's encoding.",
        removal="numpy2base64 and _new_completion_output go with a copy-free .npy encoding "
        "upstream, __init__ with rows joined on arrival upstream; JSONResponse with a "
        "response class that does not rescan base64.",
    ),
    Patch(
        hook="early_import",
        kind=Kind.ENTRY_POINT,
        targets=("vllm.platform_plugins",),
        why="LLM(enable_routed_experts=True) builds EngineArgs before vLLM loads general "
        "plugins, so the keyword would be refused on a process's first call.",
        how="vLLM calls platform plugins earlier (while resolving current_platform); ours "
        "claims no platform and installs the hooks right after vllm.engine.arg_utils loads. "
        "Not reached with VLLM_TARGET_DEVICE=cpu: import vllm_artifact.integration.plugin "
        "before LLM(...) then.",
        upstream="None found.",
        removal="General plugins loaded before EngineArgs is built.",
    ),
    Patch(
        hook="plugin",
        kind=Kind.ENTRY_POINT,
        targets=("vllm.general_plugins",),
        why="Every vLLM process (engine processes are spawned) must install the hooks.",
        how="vLLM calls plugin.register in each process; it runs apply_all.",
        upstream="vLLM's documented plugin mechanism.",
        removal="None: a supported API.",
    ),
)

_started = False


def apply_all() -> bool:
    """Install every hook once per process; returns True if this call installed them.

    On a vLLM outside the supported range only ``engine_args`` is installed (and False is
    returned): with R3 off it passes everything through, with R3 on its startup checks raise
    the version error. Re-entrant calls return at once: importing a hook module imports vLLM
    modules, which can trigger the early-import hook (and so this function) before the first
    call has finished.
    """
    global _started
    if _started:
        return False
    _started = True
    from vllm_artifact.integration.hooks.versions import support

    problem = support().problem()
    if problem is not None:
        logger.warning("vllm-artifact: hooks not installed: %s", problem)
        try:
            from vllm_artifact.integration.hooks import engine_args
        except VllmIncompatibleError as error:
            logger.warning("vllm-artifact: --enable-routed-experts is unavailable: %s", error)
            return False
        engine_args.install()
        return False
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
