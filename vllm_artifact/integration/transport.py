"""Plain dataclasses that travel between vLLM processes (pickled by vLLM's IPC).

Scheduler -> worker: :class:`ArtifactStepMetadata` rides on
``SchedulerOutput.aux_output_connector_metadata``. Worker -> scheduler: per request either
vLLM's own ``AuxRequestOutput`` (rows for tokens ``[token_start, token_start + len(rows))``) or
our :class:`RequestFailure`, inside ``ModelRunnerOutput.aux_output_connector_output``.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    AuxRequestOutput,
)

__all__ = ["ArtifactStepMetadata", "AuxRequestOutput", "RequestFailure", "StepOutput"]


@dataclass
class ArtifactStepMetadata:
    """One step's request/hash updates (vLLM's own format) plus our key namespace input."""

    step: AuxOutputConnectorMetadata
    weight_version: str


@dataclass
class RequestFailure:
    """R3 for this request cannot be delivered completely: finish it with an error.

    ``reason`` is the error's short machine-readable reason (e.g. ``missing``, ``corrupt``);
    ``message`` says what happened and what to do.
    """

    reason: str
    message: str


#: What the worker connector returns for one step.
StepOutput = dict[str, AuxRequestOutput | RequestFailure]
