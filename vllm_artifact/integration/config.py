"""``ArtifactConfig``: the one object that owns the Artifact Connector's settings.

The settings travel to every vLLM process inside ``VllmConfig.additional_config`` under
:data:`ADDITIONAL_CONFIG_KEY`: vLLM pickles that dict to every engine and worker process and
hashes it into its config hash, so no side channel (environment, files) is needed and two
engines with different store settings never share a compile cache entry by accident.
``enabled`` is not stored there: vLLM's own ``aux_output_config.enable_return_routed_experts``
is the single source of truth for "R3 on" (its capturer and compile hash key off it).

This module is pure configuration (no filesystem access); the startup checks that look at
``/dev/shm`` live in :mod:`vllm_artifact.integration.validation`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    field_validator,
    model_validator,
)

from vllm_artifact.core.store import default_root

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "ArtifactConfig",
    "parse_duration",
    "parse_size",
    "parse_switch_interval",
]

#: Key of our settings in ``VllmConfig.additional_config``.
ADDITIONAL_CONFIG_KEY = "vllm_artifact"

_BYTE_SIZE = TypeAdapter(ByteSize)
_DURATION_RE = re.compile(r"(?i)\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|h|d)?\s*")
_HOST_PORT_RE = re.compile(r"[A-Za-z0-9._-]+:\d{1,5}|\[[0-9A-Fa-f:.]+\]:\d{1,5}")
_SECONDS_PER_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: object) -> int | Literal["auto"]:
    """A store capacity in bytes, or ``"auto"`` (size it from the KV cache on the worker).

    Accepts a positive int, ``"auto"``, or a string pydantic's ``ByteSize`` understands:
    ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"1000000"`` (binary units are powers of 1024,
    decimal units powers of 1000). Raises ``ValueError`` saying what is accepted.
    """
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(
            f"capacity must be 'auto', a whole number of bytes or a size such as '8GiB', "
            f"got {value!r} ({type(value).__name__})"
        )
    if isinstance(value, str):
        try:
            value = int(_BYTE_SIZE.validate_python(value))
        except ValueError:
            raise ValueError(
                f"capacity {value!r} is not a size: use 'auto' or a number with an optional "
                "unit, such as 8GiB, 512MiB, 1.5GB or 1000000 (bytes)"
            ) from None
    if value <= 0:
        raise ValueError(f"capacity must be more than 0 bytes, got {value}")
    return value


def parse_duration(value: object) -> float:
    """A duration in seconds from a number of seconds or ``"90s"``, ``"30m"``, ``"1h"``, ``"2d"``.

    A bare number means seconds. The result must be finite and more than 0.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(
            f"duration must be a number of seconds or a string such as '1h', got {value!r} "
            f"({type(value).__name__})"
        )
    if isinstance(value, str):
        match = _DURATION_RE.fullmatch(value)
        if match is None:
            raise ValueError(
                f"duration {value!r} is not understood: use a number with an optional unit "
                "s, m, h or d, such as 90s, 30m, 1h or 3600"
            )
        seconds = float(match.group(1)) * _SECONDS_PER_UNIT[(match.group(2) or "s").lower()]
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"duration must be finite and more than 0 seconds, got {value!r}")
    return seconds


#: The GIL switch interval the output rank runs with unless told otherwise (milliseconds).
DEFAULT_SWITCH_INTERVAL_MS = 0.5
#: The longest switch interval accepted (milliseconds): CPython's own default is 5.
MAX_SWITCH_INTERVAL_MS = 100.0


def parse_switch_interval(value: object) -> float | Literal["keep"]:
    """A GIL switch interval in milliseconds, or ``"keep"`` (leave the interpreter's own).

    The result is finite, more than 0 and at most :data:`MAX_SWITCH_INTERVAL_MS`.
    """
    if isinstance(value, str) and value.strip().lower() == "keep":
        return "keep"
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(
            f"switch interval must be 'keep' or a number of milliseconds such as 0.5, got "
            f"{value!r} ({type(value).__name__})"
        )
    try:
        milliseconds = float(value)
    except ValueError:
        raise ValueError(
            f"switch interval {value!r} is not understood: use 'keep' or a number of "
            "milliseconds such as 0.5"
        ) from None
    if not math.isfinite(milliseconds) or not 0 < milliseconds <= MAX_SWITCH_INTERVAL_MS:
        raise ValueError(
            f"switch interval must be more than 0 and at most {MAX_SWITCH_INTERVAL_MS:g} ms, "
            f"got {value!r}"
        )
    return milliseconds


class ArtifactConfig(BaseModel):
    """Every setting of the Artifact Connector, validated once.

    Built in the frontend from CLI flags or ``LLM(...)`` keywords (see ``options.py``), shipped
    to every process through ``additional_config`` (:meth:`to_additional_config`), and read
    back there with :meth:`from_vllm_config`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    """R3 on: mirrors vLLM's ``aux_output_config.enable_return_routed_experts``."""
    backend: Literal["shm", "mooncake"] = "shm"
    """Object-store backend: the same-node ``/dev/shm`` store, or Mooncake Store (a
    distributed store: R3 readable from other nodes)."""
    root: Path = Field(default_factory=lambda: Path(default_root()))
    """Store root directory; must be a private directory under ``/dev/shm`` (checked at
    startup, where the filesystem is looked at)."""
    capacity: Literal["auto"] | int = "auto"
    """Bytes per engine / DP rank, or ``"auto"``: sized from the KV cache on the worker so the
    store can hold R3 for every block the KV cache can still hit."""
    ttl_seconds: float = 3600.0
    """Stores whose writer is gone are collected after this long."""
    keys_lease_seconds: float = 600.0
    """The objects a keys-only handle names stay pinned this long after the response."""
    tracker: Literal["engine", "process"] = "engine"
    """Where rank zero's request tracking and store writes run: on the engine's own thread
    (``engine``), or in a process of their own (``process``) that takes each step's rows
    through shared memory while the engine launches the next step."""
    switch_interval_ms: float | Literal["keep"] = DEFAULT_SWITCH_INTERVAL_MS
    """The GIL switch interval of the output rank's process, where the step thread shares
    one interpreter with vLLM's input thread, R3's store writer and (several GPUs) the
    output-copy thread: a thread that waits for the GIL waits up to this long (CPython's
    default is 5 ms; see ``switch_interval.py``). ``"keep"`` leaves it as it is."""
    mooncake_master: str | None = None
    """``HOST:PORT`` of the Mooncake master's RPC service (backend ``mooncake``)."""
    mooncake_metadata: str = "P2PHANDSHAKE"
    """Mooncake's metadata service: ``http://HOST:PORT/metadata`` (the master's HTTP metadata
    server) or ``P2PHANDSHAKE`` (peers exchange it directly)."""
    mooncake_host: str | None = None
    """The address other nodes reach this engine's Mooncake segment at (default: this host's
    name resolved to an address)."""
    mooncake_buffer: int = 256 * 2**20
    """Bytes of the Mooncake client's local transfer buffer (reads and writes go through it)."""
    mooncake_segment: Literal["auto"] | int = "auto"
    """Memory the engine adds to the Mooncake Store for objects: ``auto`` (the store capacity,
    at least 16 MiB; its objects go when the engine does) or 0 (none: objects go to segments
    of store nodes, ``mooncake_client`` processes, and outlive the engine)."""

    @field_validator("mooncake_segment", mode="before")
    @classmethod
    def _segment_size(cls, value: Any) -> int | Literal["auto"]:
        if value == 0 or (isinstance(value, str) and value.strip() == "0"):
            return 0
        return parse_size(value)

    @field_validator("mooncake_master", mode="before")
    @classmethod
    def _host_port(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, str) or not _HOST_PORT_RE.fullmatch(value):
            raise ValueError(f"must be HOST:PORT, e.g. 10.0.0.5:50051, got {value!r}")
        return value

    @field_validator("mooncake_buffer", mode="before")
    @classmethod
    def _buffer_size(cls, value: Any) -> int:
        size = parse_size(value)
        if size == "auto":
            raise ValueError("the Mooncake buffer takes a size, e.g. 256MiB, not 'auto'")
        return size

    @model_validator(mode="after")
    def _backend_settings(self) -> ArtifactConfig:
        if self.backend == "mooncake" and self.mooncake_master is None:
            raise ValueError(
                "the mooncake backend needs the master's address: --artifact-mooncake-master "
                "HOST:PORT (LLM keyword artifact_mooncake_master=)"
            )
        return self

    @field_validator("root", mode="before")
    @classmethod
    def _absolute_root(cls, value: Any) -> Any:
        # Relative paths would resolve against each process's working directory.
        if isinstance(value, str | Path) and not Path(value).is_absolute():
            raise ValueError(f"root must be an absolute path under /dev/shm, got {str(value)!r}")
        return value

    @field_validator("capacity", mode="before")
    @classmethod
    def _parse_capacity(cls, value: Any) -> int | Literal["auto"]:
        return parse_size(value)

    @field_validator("switch_interval_ms", mode="before")
    @classmethod
    def _parse_switch_interval(cls, value: Any) -> float | Literal["keep"]:
        return parse_switch_interval(value)

    @field_validator("ttl_seconds", "keys_lease_seconds", mode="before")
    @classmethod
    def _parse_ttl(cls, value: Any) -> float:
        return parse_duration(value)

    def to_additional_config(self) -> dict[str, Any]:
        """The JSON-safe dict stored under ``additional_config["vllm_artifact"]``.

        ``enabled`` is left out: vLLM's own flag carries it (see module docstring).
        """
        return {
            "backend": self.backend,
            "root": str(self.root),
            "capacity": self.capacity,
            "ttl_seconds": self.ttl_seconds,
            "keys_lease_seconds": self.keys_lease_seconds,
            "tracker": self.tracker,
            "switch_interval_ms": self.switch_interval_ms,
            "mooncake_master": self.mooncake_master,
            "mooncake_metadata": self.mooncake_metadata,
            "mooncake_host": self.mooncake_host,
            "mooncake_buffer": self.mooncake_buffer,
            "mooncake_segment": self.mooncake_segment,
        }

    @classmethod
    def from_additional_config(cls, additional_config: object, *, enabled: bool) -> ArtifactConfig:
        """Read our entry of an ``additional_config`` (missing entry: every default)."""
        entry: object = {}
        if isinstance(additional_config, Mapping):
            entry = additional_config.get(ADDITIONAL_CONFIG_KEY) or {}
        if not isinstance(entry, Mapping):
            raise ValueError(
                f'additional_config["{ADDITIONAL_CONFIG_KEY}"] must be a dict, got {entry!r}'
            )
        if "enabled" in entry:
            raise ValueError(
                f'additional_config["{ADDITIONAL_CONFIG_KEY}"] must not set "enabled": turn '
                "routed experts on with --enable-routed-experts"
            )
        return cls(enabled=enabled, **entry)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> ArtifactConfig:
        """The settings every vLLM process sees, from its ``VllmConfig``.

        ``enabled`` comes from ``aux_output_config.enable_return_routed_experts``, which both
        spellings of the flag (ours and vLLM's) set.
        """
        enabled = bool(vllm_config.aux_output_config.enable_return_routed_experts)
        return cls.from_additional_config(vllm_config.additional_config, enabled=enabled)
