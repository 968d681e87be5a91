"""The ids vLLM's KV cache events give blocks (rank zero unpins their objects by them)."""

from __future__ import annotations

import hashlib

from hypothesis import given
from hypothesis import strategies as st

from vllm_artifact.integration.kv_events import eviction_id, eviction_ids


@given(
    st.lists(
        st.one_of(
            st.integers(min_value=-(2**70), max_value=2**70),
            st.integers(min_value=0, max_value=2**64 - 1),
            st.binary(min_size=8, max_size=32),
        ),
        max_size=20,
    )
)
def test_eviction_ids_of_a_kv_event_are_each_hashs_eviction_id(
    block_hashes: list[bytes | int],
) -> None:
    """The batch form takes a shortcut for vLLM's 64-bit ints; any other hash (raw bytes,
    ints outside 64 bits, a mix) gets the same ids as one call each."""
    assert eviction_ids(block_hashes) == [eviction_id(h) for h in block_hashes]


def test_a_block_hash_and_vllms_int_id_of_it_are_one_eviction_id() -> None:
    """vLLM's default KV events carry the hash's last 8 bytes as an int; rank zero keys the
    block by the raw hash: both must name the same block."""
    block_hash = hashlib.sha256(b"block").digest()
    assert eviction_id(block_hash) == eviction_id(int.from_bytes(block_hash[-8:], "big"))
    assert eviction_id(block_hash) != eviction_id(hashlib.sha256(b"other").digest())
