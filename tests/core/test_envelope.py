"""Envelope: header layout, checksum binding and format validation."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from vllm_artifact.core import Envelope, R3Layout
from vllm_artifact.core.envelope import (
    HEADER_DTYPE,
    OBJECT_MAGIC,
    checksum,
    checksum_seeds,
    fill_headers,
    header_problems,
)
from vllm_artifact.core.keys import keys_to_words

LAYOUT = R3Layout(num_layers=3, top_k=2, num_experts=300, block_size=8)


def _header(key: bytes, start: int, n: int) -> np.ndarray:
    h = np.zeros(1, dtype=HEADER_DTYPE)
    fill_headers(
        h, keys_to_words([key]), np.array([start], np.uint64), np.array([n], np.uint32), LAYOUT
    )
    return h


def test_header_is_one_cache_line() -> None:
    assert HEADER_DTYPE.itemsize == 64


@given(st.binary(min_size=16, max_size=16), st.integers(0, 2**20), st.integers(1, 8))
def test_round_trip(key: bytes, block: int, n: int) -> None:
    h = _header(key, block * 8, n)
    payload = np.arange(n * LAYOUT.row_nbytes, dtype=np.uint8).data
    h["checksum"] = checksum(payload, checksum_seeds(h)[0])
    h["seq"] = 2
    env = Envelope.from_header(h[0])
    assert env.key == key and env.token_range == (block * 8, block * 8 + n)
    assert env.dtype_code == LAYOUT.dtype_code and env.payload_nbytes == n * LAYOUT.row_nbytes
    assert not header_problems(h, LAYOUT).any()


@given(
    st.sampled_from(
        [
            "key0",
            "key1",
            "token_start",
            "n_tokens",
            "schema_version",
            "dtype_code",
            "num_layers",
            "top_k",
        ]
    ),
    st.integers(1, 255),
)
def test_every_covered_field_changes_the_checksum(field: str, delta: int) -> None:
    h = _header(b"k" * 16, 16, 5)
    payload = b"\x07" * (5 * LAYOUT.row_nbytes)
    good = checksum(payload, checksum_seeds(h)[0])
    h[field] = h[field] ^ delta if field != "token_start" else h[field] + 8 * delta
    assert checksum(payload, checksum_seeds(h)[0]) != good


def test_payload_bit_flip_changes_checksum() -> None:
    h = _header(b"q" * 16, 0, 8)
    payload = bytearray(np.random.default_rng(0).bytes(8 * LAYOUT.row_nbytes))
    seed = checksum_seeds(h)[0]
    good = checksum(bytes(payload), seed)
    for pos in (0, len(payload) // 2, len(payload) - 1):
        flipped = bytearray(payload)
        flipped[pos] ^= 0x10
        assert checksum(bytes(flipped), seed) != good


def test_header_problems_flags_format_mismatches() -> None:
    base = _header(b"z" * 16, 8, 4)
    assert int(base["magic"][0]) == OBJECT_MAGIC
    for field, value in [
        ("magic", 0),
        ("schema_version", 9),
        ("dtype_code", 1),
        ("num_layers", 4),
        ("top_k", 1),
        ("n_tokens", 0),
        ("n_tokens", 9),
        ("payload_nbytes", 1),
        ("token_start", 3),
    ]:
        h = base.copy()
        h[field] = value
        assert header_problems(h, LAYOUT).all(), field
