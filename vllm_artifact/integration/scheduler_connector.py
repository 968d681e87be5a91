"""Scheduler side of the Artifact Connector (runs on the EngineCore scheduling thread).

Builds on vLLM's ``AuxOutputSchedulerConnector`` for the transport it already does well
(incremental block-hash shipping, per-step emit cursors, slicing each step's rows to the
request's executed tokens) and adds what the Artifact Connector needs:

* the weight version travels with every step's metadata, so the worker keys objects under
  the weights that produced them;
* a worker-reported :class:`RequestFailure` is recorded instead of tripping vLLM's assertion
  (which would kill the engine); the scheduler then finishes that request with an error.

Everything here is O(new hashes + scheduled requests) per step; nothing proportional to a
request's length runs at terminal time.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

from vllm_artifact.integration.transport import ArtifactStepMetadata, RequestFailure

_DEFAULT_WEIGHT_VERSION = "default"


class ArtifactSchedulerConnector(AuxOutputSchedulerConnector):
    def __init__(self) -> None:
        super().__init__()
        self.weight_version = _DEFAULT_WEIGHT_VERSION

    def set_weight_version(self, weight_version: str) -> None:
        """Key objects of later steps under ``weight_version`` (vLLM's weight-version API)."""
        self.weight_version = str(weight_version)

    def build_connector_meta(  # type: ignore[override]
        self, scheduler_output: Any, requests: dict[str, Any]
    ) -> ArtifactStepMetadata:
        step = super().build_connector_meta(scheduler_output, requests)
        return ArtifactStepMetadata(step=step, weight_version=self.weight_version)

    def take_output(self, request: Any, output: dict[str, Any] | None) -> np.ndarray | None:
        """This step's rows of ``request``; None when there are none (or it failed)."""
        entry = None if output is None else output.get(request.request_id)
        if entry is None or isinstance(entry, RequestFailure):
            return None
        return super().take_output(request, output)


def failures_in(output: dict[str, Any] | None) -> dict[str, RequestFailure]:
    """The failed requests of one step's worker output."""
    if not output:
        return {}
    return {rid: entry for rid, entry in output.items() if isinstance(entry, RequestFailure)}
