"""Envelope: header layout, checksum binding and format validation."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from vllm_artifact.core import R3Layout
from vllm_artifact.core.envelope import (
    HEADER_DTYPE,
    OBJECT_MAGIC,
    HeaderWords,
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
    """A header written for an object passes the store's read path (words) with its fields."""
    h = _header(key, block * 8, n)
    payload = np.arange(n * LAYOUT.row_nbytes, dtype=np.uint8).data
    h["checksum"] = checksum(payload, checksum_seeds(h)[0])
    h["seq"] = 2
    hw = HeaderWords(LAYOUT)
    words = HeaderWords.of(h)
    assert not hw.problems(words).any()
    assert checksum(payload, hw.seeds(words)[0]) == int(words[0, HeaderWords.CSUM])
    np.testing.assert_array_equal(
        words[:, HeaderWords.KEY0 : HeaderWords.KEY1 + 1], keys_to_words([key])
    )
    assert int(words[0, HeaderWords.START]) == block * 8 and HeaderWords.n_tokens(words)[0] == n


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


def test_header_words_layout_matches_the_dtype() -> None:
    assert HEADER_DTYPE.fields is not None
    offsets = {name: spec[1] for name, spec in HEADER_DTYPE.fields.items()}
    hw = HeaderWords
    assert offsets["seq"] == 8 * hw.SEQ and offsets["key0"] == 8 * hw.KEY0
    assert offsets["key1"] == 8 * hw.KEY1 and offsets["token_start"] == 8 * hw.START
    assert offsets["checksum"] == 8 * hw.CSUM
    assert offsets["n_tokens"] == 8 * hw.COUNT and offsets["magic"] == 8 * hw.COUNT + 4
    assert offsets["schema_version"] == 8 * hw.FORMAT and offsets["flags"] == 8 * hw.FORMAT + 3
    assert offsets["top_k"] == 8 * hw.FORMAT + 6 and offsets["payload_nbytes"] == 8 * hw.NBYTES


@given(
    st.lists(
        st.tuples(st.binary(min_size=16, max_size=16), st.integers(0, 2**20), st.integers(1, 8)),
        min_size=1,
        max_size=20,
    ),
    st.lists(st.tuples(st.integers(0, 63), st.integers(1, 255)), max_size=6),
)
def test_header_words_equal_the_structured_functions(
    objs: list[tuple[bytes, int, int]], flips: list[tuple[int, int]]
) -> None:
    """The vectorized word path builds, checks and seeds exactly like the
    field-wise functions, also on headers with flipped bytes."""
    hw = HeaderWords(LAYOUT)
    words = keys_to_words([k for k, _, _ in objs])
    starts = np.array([8 * b for _, b, _ in objs], np.uint64)
    counts = np.array([n for _, _, n in objs], np.int64)
    h = np.zeros(len(objs), dtype=HEADER_DTYPE)
    fill_headers(h, words, starts, counts.astype(np.uint32), LAYOUT)
    built = hw.build(words, starts, counts)
    assert built.tobytes() == h.tobytes()
    assert hw.seeds_for(words, starts, counts) == checksum_seeds(h)
    raw = h.view(np.uint8).reshape(len(objs), 64)
    for pos, delta in flips:
        if pos >= 48 or 40 <= pos < 48 or 24 <= pos < 32:  # format fields, counts, start
            raw[0, pos] ^= delta
    w = HeaderWords.of(h)
    np.testing.assert_array_equal(hw.problems(w), header_problems(h, LAYOUT))
    ok = ~header_problems(h, LAYOUT)
    assert [s for s, g in zip(hw.seeds(w), ok, strict=True) if g] == [
        s for s, g in zip(checksum_seeds(h), ok, strict=True) if g
    ]
    assert HeaderWords.as_headers(w).tobytes() == h.tobytes()
