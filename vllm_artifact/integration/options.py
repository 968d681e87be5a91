"""The user-facing options of the Artifact Connector: one table for CLI flags and LLM keywords.

Both spellings of the enable flag mean the same thing: ``--enable-routed-experts`` is ours
(canonical), ``--enable-return-routed-experts`` is vLLM's own and keeps working unchanged.
The store options (``--artifact-*`` / ``artifact_*``) are validated into an
:class:`~vllm_artifact.integration.config.ArtifactConfig` when ``EngineArgs`` is built and
stored in ``additional_config["vllm_artifact"]``, which vLLM ships to every process.

Inert when off: with R3 off and none of our options given, nothing here touches the
arguments, so ``EngineArgs`` is exactly what vLLM alone would build.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from vllm_artifact.errors import ArtifactConfigError
from vllm_artifact.integration.config import (
    ADDITIONAL_CONFIG_KEY,
    ArtifactConfig,
    parse_duration,
    parse_size,
    parse_switch_interval,
)

#: ``LLM(...)`` / ``EngineArgs(...)`` keyword that turns routed-experts (R3) output on.
ENABLE_KWARG = "enable_routed_experts"
#: Canonical CLI flag; vLLM's ``--enable-return-routed-experts`` stays an alias.
ENABLE_FLAG = "--enable-routed-experts"
#: vLLM's own EngineArgs field that switches capture on (compile hash and call sites key off it).
VLLM_ENABLE_FIELD = "enable_return_routed_experts"


@dataclass(frozen=True)
class StoreOption:
    """One store setting: its keyword, CLI flag and ``ArtifactConfig`` field."""

    kwarg: str
    field: str
    metavar: str
    example: str
    parse: Callable[[Any], Any]
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.kwarg.replace("_", "-")

    @property
    def spellings(self) -> str:
        return f"{self.flag} / {self.kwarg}="


STORE_OPTIONS: tuple[StoreOption, ...] = (
    StoreOption(
        kwarg="artifact_backend",
        field="backend",
        metavar="{shm,mooncake}",
        example="mooncake",
        parse=str,
        choices=("shm", "mooncake"),
        help="Object store for R3 objects: 'shm' (same-node /dev/shm) or 'mooncake' (Mooncake "
        "Store, readable from other nodes; needs vllm-artifact[mooncake] and "
        "--artifact-mooncake-master). Default: shm.",
    ),
    StoreOption(
        kwarg="artifact_root",
        field="root",
        metavar="PATH",
        example="/dev/shm/vllm-artifact-rl",
        parse=str,
        help="Store root: a directory under /dev/shm owned by you with mode 0700 (created "
        "if missing; its parent must exist). Default: /dev/shm/vllm-artifact-<uid>.",
    ),
    StoreOption(
        kwarg="artifact_capacity",
        field="capacity",
        metavar="SIZE|auto",
        example="8GiB",
        parse=parse_size,
        help="Store size per engine / DP rank, e.g. 8GiB, 512MiB, 1.5GB or bytes. 'auto' "
        "sizes it from the KV cache (GPU plus offloaded blocks) so every block the KV cache "
        "can hit keeps its R3. Default: auto.",
    ),
    StoreOption(
        kwarg="artifact_ttl",
        field="ttl_seconds",
        metavar="DURATION",
        example="1h",
        parse=parse_duration,
        help="Stores whose engine is gone are deleted after this long, e.g. 90s, 30m, 1h, "
        "2d or seconds. Default: 1h.",
    ),
    StoreOption(
        kwarg="artifact_keys_lease",
        field="keys_lease_seconds",
        metavar="DURATION",
        example="10m",
        parse=parse_duration,
        help="The objects a keys-only handle names stay in the store (pinned) this long after "
        "the response, however full the store gets: read handles within it, e.g. 90s, 10m or "
        "seconds. Leased objects count against --artifact-capacity. Default: 10m.",
    ),
    StoreOption(
        kwarg="artifact_tracker",
        field="tracker",
        metavar="{engine,process}",
        example="process",
        parse=str,
        choices=("engine", "process"),
        help="Where rank zero tracks requests and writes the store: 'engine' (the engine's "
        "own thread) or 'process' (a process of its own, fed each step's rows through shared "
        "memory; frees the engine's thread where it, not the GPU, bounds throughput). "
        "Default: engine.",
    ),
    StoreOption(
        kwarg="artifact_switch_interval_ms",
        field="switch_interval_ms",
        metavar="MS|keep",
        example="0.5",
        parse=parse_switch_interval,
        help="The GIL switch interval, in milliseconds, of rank zero's worker process (with "
        "one GPU, the engine core): how long its step thread may wait for the interpreter "
        "while another thread (vLLM's input thread, R3's store writer) holds it. 'keep' "
        "leaves Python's own (5 ms). Default: 0.5.",
    ),
    StoreOption(
        kwarg="artifact_mooncake_master",
        field="mooncake_master",
        metavar="HOST:PORT",
        example="10.0.0.5:50051",
        parse=str,
        help="Backend mooncake: the Mooncake master's RPC address (mooncake_master --rpc_port).",
    ),
    StoreOption(
        kwarg="artifact_mooncake_metadata",
        field="mooncake_metadata",
        metavar="URL|P2PHANDSHAKE",
        example="http://10.0.0.5:8080/metadata",
        parse=str,
        help="Backend mooncake: the metadata service, the master's HTTP metadata server "
        "(mooncake_master --enable_http_metadata_server) or P2PHANDSHAKE. Default: "
        "P2PHANDSHAKE.",
    ),
    StoreOption(
        kwarg="artifact_mooncake_host",
        field="mooncake_host",
        metavar="ADDRESS",
        example="10.0.0.7",
        parse=str,
        help="Backend mooncake: the address other nodes reach this engine's segment at. "
        "Default: this host's name, resolved.",
    ),
    StoreOption(
        kwarg="artifact_mooncake_buffer",
        field="mooncake_buffer",
        metavar="SIZE",
        example="256MiB",
        parse=parse_size,
        help="Backend mooncake: the client's local transfer buffer. Default: 256MiB.",
    ),
    StoreOption(
        kwarg="artifact_mooncake_segment",
        field="mooncake_segment",
        metavar="SIZE|auto|0",
        example="0",
        parse=lambda value: 0 if str(value).strip() == "0" else parse_size(value),
        help="Backend mooncake: memory this engine adds to the store for objects. 'auto': "
        "the store capacity (at least 16MiB), objects go when the engine does; 0: none, "
        "objects go to store nodes (mooncake_client) and outlive the engine. Default: auto.",
    ),
)

OPTIONS_BY_KWARG = {option.kwarg: option for option in STORE_OPTIONS}
OPTIONS_BY_FIELD = {option.field: option for option in STORE_OPTIONS}
OUR_KWARGS = frozenset({ENABLE_KWARG, *OPTIONS_BY_KWARG})


def add_cli_args(parser: Any) -> None:
    """Add our flags in their own argument group of vLLM's parser."""
    group = parser.add_argument_group(
        title="Artifact Connector (vllm-artifact)",
        description="Routed-experts (R3) output for RL training of MoE models.",
    )
    group.add_argument(
        ENABLE_FLAG,
        dest=ENABLE_KWARG,
        action="store_true",
        default=False,
        help="Return, on each finished completion, the top-k expert IDs the router chose "
        "for every token and MoE layer (base64 .npy in HTTP responses, a numpy array "
        "offline). Same as vLLM's --enable-return-routed-experts.",
    )
    for option in STORE_OPTIONS:
        group.add_argument(
            option.flag,
            dest=option.kwarg,
            type=_cli_type(option),
            choices=option.choices,
            default=None,
            metavar=option.metavar,
            help=option.help,
        )


def _cli_type(option: StoreOption) -> Callable[[str], Any]:
    """argparse ``type=``: bad values fail while parsing, naming the flag and an example."""

    def convert(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(
                f"{err} (example: {option.flag} {option.example})"
            ) from None

    convert.__name__ = option.kwarg  # argparse names the type in some messages
    return convert


def pop_artifact_kwargs(kwargs: MutableMapping[str, Any]) -> dict[str, Any]:
    """Remove our keyword arguments from ``kwargs`` and return them.

    ``None`` means "not given" for the store options (so the CLI's defaults stay unset).
    """
    ours = {name: kwargs.pop(name) for name in OUR_KWARGS if name in kwargs}
    enable = ours.get(ENABLE_KWARG)
    if enable is not None and not isinstance(enable, bool):
        raise TypeError(
            f"{ENABLE_KWARG} must be True or False, got {enable!r} ({type(enable).__name__})"
        )
    return {name: value for name, value in ours.items() if value is not None}


def from_namespace(args: argparse.Namespace) -> dict[str, Any]:
    """Our store options given on the command line (flags left at their default are absent)."""
    return {
        option.kwarg: getattr(args, option.kwarg)
        for option in STORE_OPTIONS
        if getattr(args, option.kwarg, None) is not None
    }


def apply_to_engine_kwargs(kwargs: MutableMapping[str, Any], ours: dict[str, Any]) -> None:
    """Translate our enable keyword into the field vLLM's ``EngineArgs`` already has.

    ``enable_routed_experts=True`` turns on vLLM's own capture flag: the capturer, the compile
    hash and every call site key off it, so both spellings end in the same configuration.
    """
    if ours.get(ENABLE_KWARG):
        kwargs[VLLM_ENABLE_FIELD] = True


def attach_store_options(engine_args: Any, ours: dict[str, Any]) -> None:
    """Validate our store options and store them in ``engine_args.additional_config``.

    Runs after vLLM's ``__init__``, when ``aux_output_config`` says whether R3 is on (either
    spelling, or ``aux_output_config={...}``). With R3 on, the entry is always written (every
    default included) so all processes read identical settings; keys the user already put in
    ``additional_config["vllm_artifact"]`` are kept unless a flag or keyword overrides them.
    With R3 off, given store options are an error and nothing is written.
    """
    given = [OPTIONS_BY_KWARG[name] for name in ours if name in OPTIONS_BY_KWARG]
    if not engine_args.aux_output_config.enable_return_routed_experts:
        if given:
            option = given[0]
            raise ArtifactConfigError(
                f"{option.flag} has no effect without {ENABLE_FLAG}: add {ENABLE_FLAG} "
                f"(LLM keyword enable_routed_experts=True), or drop {option.flag} "
                f"({option.kwarg})."
            )
        return
    additional = engine_args.additional_config
    if not isinstance(additional, dict):
        raise ArtifactConfigError(
            f"{ENABLE_FLAG} stores its settings in additional_config, which must be a dict "
            f"here, got {type(additional).__name__}"
        )
    try:
        base = ArtifactConfig.from_additional_config(additional, enabled=True)
        overrides = {option.field: ours[option.kwarg] for option in given}
        config = ArtifactConfig(**{**base.model_dump(), **overrides})
    except ValidationError as err:
        raise _config_error(err) from None
    except ValueError as err:
        raise ArtifactConfigError(str(err)) from None
    # A new dict: never mutate the caller's additional_config.
    engine_args.additional_config = {
        **additional,
        ADDITIONAL_CONFIG_KEY: config.to_additional_config(),
    }


def _config_error(err: ValidationError) -> ArtifactConfigError:
    """Name the flag and keyword, and give a valid example, for each invalid setting."""
    lines = []
    for error in err.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        cause = (error.get("ctx") or {}).get("error")
        why = str(cause) if cause is not None else error["msg"]
        option = OPTIONS_BY_FIELD.get(field)
        if option is None:
            lines.append(f'additional_config["{ADDITIONAL_CONFIG_KEY}"]["{field}"]: {why}')
        else:
            lines.append(
                f"{option.spellings}{error['input']!r}: {why} "
                f"(example: {option.flag} {option.example})"
            )
    return ArtifactConfigError("invalid vllm-artifact setting: " + "; ".join(lines))
