"""Typed exceptions of the whole product, in one place.

Every exception carries a short machine-readable ``reason`` and a message that says what
to do about it. A request failed closed carries both to its caller: the scheduler finishes
it with finish reason ``error`` and ``stop_reason`` ``vllm-artifact[<reason>] <message>``
(:class:`~vllm_artifact.core.failure.R3Failure`); the frontend counts it by reason
(``vllm_artifact_failed_requests_total``) and the OpenAI server answers it with HTTP 500 and
that message (``integration/hooks/request_errors.py``).
"""

from __future__ import annotations

__all__ = [
    "ArtifactConfigError",
    "ArtifactError",
    "BufferCapacityError",
    "CapacityError",
    "InternalError",
    "KeyCollisionError",
    "NotOnNodeError",
    "ObjectCorruptError",
    "ObjectMissingError",
    "RowBufferError",
    "RowGapError",
    "SchemaError",
    "ShmSpaceError",
    "StoreClosedError",
    "StoreError",
    "StoreFormatError",
    "StoreNotFoundError",
    "StoreReadOnlyError",
    "StoreUnavailableError",
    "TrackerProcessError",
    "UnknownRequestError",
    "UnsafeRootError",
    "VllmIncompatibleError",
    "WeightVersionError",
    "WeightVersionMismatchError",
    "WriterConflictError",
]


class ArtifactError(Exception):
    """Base class of every error raised on purpose by vllm-artifact."""

    reason: str = "artifact"


class SchemaError(ArtifactError, ValueError):
    """An R3 layout or an array does not follow the schema (dtype, shape, ids)."""

    reason = "schema"


class WeightVersionError(SchemaError):
    """A weight version our object keys cannot carry (refused before the engine records it)."""

    reason = "weight_version"


# --------------------------------------------------------------------------- store


class StoreError(ArtifactError):
    """Base class of object-store failures."""

    reason = "store"


class ObjectMissingError(StoreError):
    """A requested object is not in the store (evicted, never published)."""

    reason = "missing"


class ObjectCorruptError(StoreError):
    """An object failed envelope or checksum validation on read."""

    reason = "corrupt"


class NotOnNodeError(ObjectMissingError):
    """Objects of a KV hit are in no store of the model under the root on this node (the KV
    came from an engine on another node or root, or its store lost them). ``absent``: the
    positions of the keys found nowhere."""

    def __init__(self, message: str, *, absent: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.absent = absent


class WeightVersionMismatchError(ObjectMissingError):
    """The R3 of a KV hit exists on the node only under another weight version (the engine that
    computed the KV, e.g. a PD producer, runs other weights): never mixed, the request fails."""

    reason = "weight_mismatch"


class KeyCollisionError(StoreError):
    """The same key was published twice with different content."""

    reason = "collision"


class CapacityError(StoreError):
    """The store cannot make room: pinned objects alone fill it."""

    reason = "capacity"


class ShmSpaceError(StoreError):
    """/dev/shm cannot hold the configured store capacity."""

    reason = "shm_space"


class StoreClosedError(StoreError):
    """The store handle was closed."""

    reason = "closed"


class StoreReadOnlyError(StoreError):
    """A mutating call was made on a read-only store handle."""

    reason = "read_only"


class StoreUnavailableError(StoreError):
    """A remote store cannot be reached (its master is down, unreachable or restarting):
    nothing was read, and a write may be partial."""

    reason = "unavailable"


class StoreNotFoundError(StoreError):
    """No store with that name exists under the root."""

    reason = "store_missing"


class StoreFormatError(StoreError):
    """A store file exists but is not a valid store of the expected format."""

    reason = "store_format"


class UnsafeRootError(StoreError):
    """The store root is not a private directory under /dev/shm."""

    reason = "unsafe_root"


class WriterConflictError(StoreError):
    """Another live process already owns the store as its writer."""

    reason = "writer_conflict"


# ------------------------------------------------------------------------- buffer


class RowBufferError(ArtifactError):
    """Base class of logical request-buffer failures."""

    reason = "buffer"


class RowGapError(RowBufferError):
    """Rows were appended after a gap, or a block lacks its first rows."""

    reason = "gap"


class BufferCapacityError(RowBufferError):
    """The request buffer would exceed its memory bound."""

    reason = "buffer_capacity"


class UnknownRequestError(RowBufferError, KeyError):
    """The buffer holds no rows for that request id."""

    reason = "unknown_request"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class ArtifactConfigError(ArtifactError, ValueError):
    """An invalid or unsupported configuration, detected at startup (before engines start)."""

    reason = "config"


class VllmIncompatibleError(ArtifactError, RuntimeError):
    """The installed vLLM lacks a name or shape one of our hooks was written against (checked
    when the hook is installed, so a vLLM upgrade fails at startup, never silently)."""

    reason = "vllm_incompatible"


class InternalError(ArtifactError, RuntimeError):
    """A broken invariant of vllm-artifact itself (a bug: please report it). Raised where an
    ``assert`` would vanish under ``python -O``; per-request paths turn it into a failed
    request, never a dead engine."""

    reason = "internal"


class TrackerProcessError(ArtifactError, RuntimeError):
    """The tracker process (``--artifact-tracker process``) did not start, or has gone: R3
    requests in flight fail with this, and the engine goes on serving."""

    reason = "tracker_process"
