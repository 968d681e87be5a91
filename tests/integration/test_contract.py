"""The connector contract: vLLM's connector classes are checked against it when the
integration imports, and our connectors implement it."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector, PendingAuxOutput

from vllm_artifact.contract import PendingStep, SchedulerConnector, WorkerConnector
from vllm_artifact.errors import VllmIncompatibleError
from vllm_artifact.integration import vllm_contract
from vllm_artifact.integration.scheduler_connector import ArtifactSchedulerConnector
from vllm_artifact.integration.vllm_contract import check_vllm_connectors, contract_mismatches
from vllm_artifact.integration.worker_connector import (
    ArtifactWorkerConnector,
    PendingArtifactStep,
)


def test_importing_the_integration_fails_when_vllm_lost_a_connector_method(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("ArtifactStepMetadata", "check_vllm_connectors", "contract_mismatches"):
        monkeypatch.setattr(vllm_contract, name, getattr(vllm_contract, name))  # kept as is
    monkeypatch.delattr(AuxOutputWorkerConnector, "prepare_output")
    with pytest.raises(
        VllmIncompatibleError, match=r"AuxOutputWorkerConnector\.prepare_output is gone"
    ):
        importlib.reload(vllm_contract)


def test_a_renamed_parameter_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """MRV2 passes enqueue_cpu_copy's arguments by keyword: a rename would break our call."""

    def enqueue_cpu_copy(self: object, sampled: np.ndarray, num_rejected: np.ndarray) -> None:
        pass

    monkeypatch.setattr(PendingAuxOutput, "enqueue_cpu_copy", enqueue_cpu_copy)
    with pytest.raises(VllmIncompatibleError, match=r"enqueue_cpu_copy takes \(self, sampled"):
        check_vllm_connectors()


@pytest.mark.parametrize(
    ("ours", "protocol"),
    [
        (ArtifactSchedulerConnector, SchedulerConnector),
        (ArtifactWorkerConnector, WorkerConnector),
        (PendingArtifactStep, PendingStep),
    ],
)
def test_our_connectors_implement_the_contract(ours: type, protocol: type) -> None:
    assert contract_mismatches(ours, protocol) == []
