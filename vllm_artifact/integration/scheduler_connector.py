"""Scheduler side of the Artifact Connector (runs on the EngineCore scheduling thread).

Builds on vLLM's ``AuxOutputSchedulerConnector`` for the transport it already does well
(incremental block-hash shipping, per-step emit cursors, slicing each step's rows to the
request's executed tokens) and adds what the Artifact Connector needs:

* the weight version travels with every step's metadata, so the worker keys objects under
  the weights that produced them;
* a request that finished normally gets its terminal partial block hashed like a KV block
  (same hash function, parent and extra keys), so the worker can publish it as an object;
* KV cache evictions (vLLM's KV cache events) are forwarded, so the worker unpins exactly the
  objects no KV block can hit any more;
* a worker-reported :class:`RequestFailure` is recorded instead of tripping vLLM's assertion
  (which would kill the engine); the scheduler then finishes that request with an error.

Everything here is O(new hashes + scheduled requests) per step; nothing proportional to a
request's length runs at terminal time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens
from vllm.v1.request import RequestStatus

from vllm_artifact.core.tracker import eviction_id
from vllm_artifact.integration.transport import ArtifactStepMetadata, RequestFailure

_DEFAULT_WEIGHT_VERSION = "default"
#: Finishes whose last rows become a tail object; aborted, preempted and failed requests keep
#: only their published full blocks.
_PUBLISH_TAIL_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED}
)


class ArtifactSchedulerConnector(AuxOutputSchedulerConnector):
    def __init__(
        self,
        *,
        hash_fn: Callable[[Any], bytes] | None = None,
        hash_block_size: int | None = None,
    ) -> None:
        super().__init__()
        assert isinstance(getattr(self, "_sent_hash_counts", None), dict), (
            "vLLM's AuxOutputSchedulerConnector no longer tracks _sent_hash_counts; "
            "vllm-artifact's scheduler connector was written for vLLM 0.32 and must be updated"
        )
        self.weight_version = _DEFAULT_WEIGHT_VERSION
        self._hash_fn = hash_fn
        self._hash_block_size = hash_block_size
        self._tails: dict[str, tuple[bytes, int]] = {}
        self._kv_evicted: list[int] = []
        self._kv_cleared = False

    def observe_kv_events(self, events: list[Any] | None) -> None:
        """Note KV evictions (vLLM KV cache events) so the worker can unpin their objects."""
        for event in events or ():
            if isinstance(event, BlockRemoved):
                self._kv_evicted.extend(eviction_id(h) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self._kv_cleared = True
                self._kv_evicted.clear()

    def request_finished(self, request: Any) -> None:
        """Also hash the terminal partial block of a request that finished normally."""
        if (
            request.status in _PUBLISH_TAIL_STATUSES
            and request.request_id in self._sent_hash_counts
        ):
            tail = self._tail_hash(request)
            if tail is not None:
                self._tails[request.request_id] = tail
        super().request_finished(request)

    def _tail_hash(self, request: Any) -> tuple[bytes, int] | None:
        """Hash of the rows after the last full block, like a KV block hash of those tokens.

        Rows exist for every token but the last sampled one, so the tail covers tokens
        ``[full * bs, num_tokens - 1)``; its parent is the last full block's hash.
        """
        if self._hash_fn is None or self._hash_block_size is None:
            return None
        bs = self._hash_block_size
        executed = request.num_tokens - 1
        full = executed // bs
        if executed <= full * bs or len(request.block_hashes) < full:
            return None
        tokens = request.all_token_ids[full * bs : executed]
        parent = request.block_hashes[full - 1] if full else None
        extra_keys, _ = generate_block_hash_extra_keys(request, full * bs, executed, 0)
        return bytes(hash_block_tokens(self._hash_fn, parent, tokens, extra_keys)), len(tokens)

    def set_weight_version(self, weight_version: str) -> None:
        """Key objects of later steps under ``weight_version`` (vLLM's weight-version API)."""
        self.weight_version = str(weight_version)

    def build_connector_meta(  # type: ignore[override]
        self, scheduler_output: Any, requests: dict[str, Any]
    ) -> ArtifactStepMetadata:
        step = super().build_connector_meta(scheduler_output, requests)
        tails, self._tails = self._tails, {}
        evicted, self._kv_evicted = self._kv_evicted, []
        cleared, self._kv_cleared = self._kv_cleared, False
        return ArtifactStepMetadata(
            step=step,
            weight_version=self.weight_version,
            tails=tails,
            kv_evicted=evicted,
            kv_cleared=cleared,
        )

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
