"""The halves of the connector contract (:mod:`vllm_artifact.contract`) that need vLLM.

:class:`ArtifactStepMetadata` is vLLM's step metadata with our fields, so our scheduler
connector's ``build_connector_meta`` returns what vLLM declares. Importing this module checks
that vLLM's connector classes still have every method the contract's protocols name, with the
same parameter names (MRV2 passes some by keyword): a vLLM that renamed one fails here with
:class:`~vllm_artifact.errors.VllmIncompatibleError`, not with a connector vLLM never calls.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from vllm.distributed.aux_output_connector.connector import (
    AuxOutputConnectorMetadata,
    AuxOutputSchedulerConnector,
)
from vllm.distributed.aux_output_connector.worker import AuxOutputWorkerConnector, PendingAuxOutput

from vllm_artifact.contract import (
    ArtifactStepFields,
    HitCappingSchedulerConnector,
    PendingStep,
    SchedulerConnector,
    StorageWorkerConnector,
    WorkerConnector,
)
from vllm_artifact.integration.hooks import require
from vllm_artifact.integration.seams import SERIES

__all__ = ["ArtifactStepMetadata", "check_vllm_connectors", "contract_mismatches"]


@dataclass
class ArtifactStepMetadata(AuxOutputConnectorMetadata, ArtifactStepFields):
    """One step's scheduler -> worker metadata: vLLM's fields (positional), then ours
    (keywords). It rides on ``SchedulerOutput.aux_output_connector_metadata``."""


def contract_mismatches(cls: type, protocol: type) -> list[str]:
    """The methods of ``protocol`` that ``cls`` lacks or takes under other parameter names."""
    problems = []
    for name, wanted in vars(protocol).items():
        if name.startswith("_") or not inspect.isfunction(wanted):
            continue
        method = getattr(cls, name, None)
        if not callable(method):
            problems.append(f"{cls.__qualname__}.{name} is gone")
            continue
        want = list(inspect.signature(wanted).parameters)
        have = list(inspect.signature(method).parameters)
        if have != want:
            problems.append(
                f"{cls.__qualname__}.{name} takes ({', '.join(have)}), not ({', '.join(want)})"
            )
    return problems


def check_vllm_connectors() -> None:
    """vLLM's connector classes still match the contract's protocols of the installed
    series (typed error if not)."""
    pairs: list[tuple[type, type]] = [
        (SchedulerConnector, AuxOutputSchedulerConnector),
        (WorkerConnector, AuxOutputWorkerConnector),
        (PendingStep, PendingAuxOutput),
    ]
    if SERIES == "0.34":
        pairs += [
            (HitCappingSchedulerConnector, AuxOutputSchedulerConnector),
            (StorageWorkerConnector, AuxOutputWorkerConnector),
        ]
    problems = [
        problem for protocol, cls in pairs for problem in contract_mismatches(cls, protocol)
    ]
    require(not problems, "connector", "vLLM's connector methods changed: " + "; ".join(problems))


check_vllm_connectors()
