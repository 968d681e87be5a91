"""vLLM 0.34's seams (see the package docstring).

vLLM 0.34's ``AuxOutputSchedulerConnector`` keeps its own LRU of blocks whose R3 its
in-process store retains, and caps every prefix hit to those blocks (a hit on blocks without
stored R3 is recomputed; an external KV hit it cannot vouch for is dropped entirely). Our
store is another one (``/dev/shm`` or Mooncake, shared across engines and restarts, pinned by
KV events), and our contract is that the KV cache stays authoritative: a hit is never
shortened, a missing object fails that one request closed. So this base keeps 0.32's
behaviour: no cap, no retained/released bookkeeping (its block lookups would cost O(blocks)
per finished request), the finish queues the request's unsent hashes as 0.32 did.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm.distributed.aux_output_connector.connector import (
    AuxOutputSchedulerConnector,
    PackedBlockHashes,
)

from vllm_artifact.integration.hooks.patching import require

SERIES = "0.34"
WORKER_FACTORY_PARAMETERS = ("model", "vllm_config")

_UPSTREAM: Any = AuxOutputSchedulerConnector  # typed against 0.32 by mypy
_logger = logging.getLogger("vllm.artifact")


def prepare_engine_args(engine_args: Any) -> None:
    """Speculative decoding keys KV blocks as on 0.32: no lookahead block hashes.

    With them (0.34's EAGLE-style drafters with block drop), a block's hash also covers the
    next tokens and is made only once they exist, so a finished request's last full blocks
    have no hash: their R3 could be neither published nor named in a keys handle. vLLM falls
    back to the same setting for KV connectors that do not support lookahead hashes; every
    engine sharing a store then keys blocks alike. An explicit user setting is kept.
    """
    speculative = engine_args.speculative_config
    if isinstance(speculative, dict) and "disable_lookahead_block_hashes" not in speculative:
        engine_args.speculative_config = {**speculative, "disable_lookahead_block_hashes": True}
        _logger.info(
            "vllm-artifact: speculative decoding without lookahead block hashes, so every "
            "finished block of R3 has its key (set disable_lookahead_block_hashes in "
            "--speculative-config to choose otherwise)"
        )


class SchedulerConnectorBase(AuxOutputSchedulerConnector):
    """vLLM 0.34's scheduler connector with 0.32's hit semantics (see the module docstring)."""

    def __init__(self, kv_cache_manager: Any = None, kv_connector: Any = None) -> None:
        _UPSTREAM.__init__(self, kv_cache_manager, kv_connector)
        require(
            callable(getattr(self, "_pack_hashes", None)),
            "scheduler_connector",
            "vLLM's AuxOutputSchedulerConnector._pack_hashes is gone",
        )

    def _pack_new(self, block_hashes: Sequence[bytes], num_sent: int) -> PackedBlockHashes | None:
        """The hashes after the first ``num_sent``, packed by vLLM (None if there are none)."""
        packed: PackedBlockHashes | None = self._pack_hashes(  # type: ignore[attr-defined]
            block_hashes[num_sent:]
        )
        return packed

    def max_cache_hit(self, request: Any) -> int | None:
        """No bound from R3: the KV cache decides (vLLM's default limit applies)."""
        return None

    def cap_external_hit(self, request: Any, num_local: int, num_external: int) -> int:
        """A KV connector's hit is kept whole (R3 is read per key from the node's stores)."""
        return num_external

    def request_loading(self, request: Any, num_tokens: int) -> None:
        """Nothing to protect: pins follow the KV cache's own events."""

    def request_finished(self, request: Any) -> None:
        """Queue the finish and the hashes not sent yet (0.32's semantics)."""
        num_sent = self._sent_hash_counts.pop(request.request_id, None)
        if num_sent is not None:
            self._finished_requests[request.request_id] = self._pack_new(
                request.block_hashes, num_sent
            )
