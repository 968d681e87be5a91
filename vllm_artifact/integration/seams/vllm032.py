"""vLLM 0.32's seams (see the package docstring): the connector is built without arguments
and packs hashes with ``_pack_new_hashes``; the worker factory gets the KV cache layout."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.aux_output_connector.connector import (
    AuxOutputSchedulerConnector,
    PackedBlockHashes,
)

from vllm_artifact.integration.hooks.patching import require

SERIES = "0.32"
WORKER_FACTORY_PARAMETERS = ("model", "vllm_config", "kv_cache_config")


def prepare_engine_args(engine_args: Any) -> None:
    """Nothing to adjust on 0.32 (see the 0.34 twin)."""


class SchedulerConnectorBase(AuxOutputSchedulerConnector):
    """vLLM 0.32's scheduler connector behind the constructor and packer both series share."""

    def __init__(self, kv_cache_manager: Any = None, kv_connector: Any = None) -> None:
        super().__init__()  # 0.32's takes no arguments
        require(
            callable(getattr(self, "_pack_new_hashes", None)),
            "scheduler_connector",
            "vLLM's AuxOutputSchedulerConnector._pack_new_hashes is gone",
        )

    def _pack_new(self, block_hashes: Sequence[bytes], num_sent: int) -> PackedBlockHashes | None:
        """The hashes after the first ``num_sent``, packed by vLLM (None if there are none)."""
        return self._pack_new_hashes(block_hashes, num_sent)
