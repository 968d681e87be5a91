"""Plain dataclasses that travel between vLLM processes (pickled by vLLM's IPC).

Scheduler -> worker: :class:`ArtifactStepMetadata` rides on
``SchedulerOutput.aux_output_connector_metadata``. Worker -> scheduler: one
:class:`~vllm_artifact.core.tracker.StepResult` (decode rows column-wise, other requests'
rows or :class:`RequestFailure`) in ``ModelRunnerOutput.aux_output_connector_output``, where
vLLM's own connector puts a dict of ``AuxRequestOutput``; only our scheduler connector reads
it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata

# A request whose R3 cannot be delivered completely: the scheduler finishes it with an error.
# ``reason`` is the error's short reason (``missing``, ``corrupt``, ...); ``message`` says what
# happened and what to do. It reaches the frontend in ``stop_reason``.
from vllm_artifact.core.failure import R3Failure as RequestFailure
from vllm_artifact.core.tracker import StepResult, TailBlock

__all__ = ["ArtifactStepMetadata", "RequestFailure", "StepResult"]


@dataclass
class ArtifactStepMetadata:
    """One step's request/hash updates (vLLM's own format) plus our key namespace input."""

    step: AuxOutputConnectorMetadata
    weight_version: str
    #: Requests that finished normally (not aborted, preempted or failed) with a terminal
    #: partial block: request id -> its hash, first token and token count. The hash is
    #: computed like a KV block hash (same function, parent hash and extra keys) over the
    #: tail's tokens.
    tails: dict[str, TailBlock] = field(default_factory=dict)
    #: Blocks the KV cache evicted since the last step (ids from ``eviction_id``), and whether
    #: it dropped every block (prefix-cache reset): their objects stop being pinned.
    kv_evicted: list[int] = field(default_factory=list)
    kv_cleared: bool = False
    #: Keys-only requests answered with a handle since the last step: rank zero leases the
    #: objects the handle names (``--artifact-keys-lease``).
    leases: list[str] = field(default_factory=list)
