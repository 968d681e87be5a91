"""The ``.npy`` base64 wire format: our encoder must give exactly ``np.save`` + base64's text
(numpy and the standard library are the oracle), and the decoder must be strict."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from vllm_artifact.core import npy
from vllm_artifact.core.npy import (
    concatenate_into_npy,
    decode_npy_base64,
    encode_npy_base64,
    npy_file_of,
)


def reference(array: np.ndarray) -> str:
    """What vLLM's ``numpy2base64`` sends: ``np.save`` bytes, base64 (stdlib here)."""
    fp = io.BytesIO()
    np.save(fp, array, allow_pickle=False)
    return base64.b64encode(fp.getvalue()).decode("ascii")


DTYPES = st.sampled_from(
    [np.uint8, np.uint16, ">u2", np.int32, np.float32, np.float64, np.bool_, np.complex64]
)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(DTYPES, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=7)))
def test_encoding_is_np_save_base64(array: np.ndarray) -> None:
    assert encode_npy_base64(array) == reference(array)
    if array.ndim >= 2:  # Fortran order and strided views take the other paths
        assert encode_npy_base64(np.asfortranarray(array)) == reference(np.asfortranarray(array))
        assert encode_npy_base64(array[:, ::2]) == reference(array[:, ::2])


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([np.uint8, np.uint16, np.int64]),
    st.lists(st.integers(0, 9), min_size=1, max_size=6),
    st.tuples(st.integers(1, 5), st.integers(1, 4)),
)
def test_concatenation_is_np_concatenate_and_encodes_without_a_copy(
    dtype: type, lengths: list[int], row: tuple[int, int]
) -> None:
    rng = np.random.default_rng(sum(lengths))
    chunks = [rng.integers(0, 200, size=(n, *row)).astype(dtype) for n in lengths]
    merged = concatenate_into_npy(chunks)
    assert merged is not None
    np.testing.assert_array_equal(merged, np.concatenate(chunks, axis=0))
    assert merged.dtype == dtype and merged.flags.writeable
    if merged.size:  # an empty array has no data part to find
        file = npy_file_of(merged)
        assert file is not None and file.nbytes > merged.nbytes
    assert encode_npy_base64(merged) == reference(merged)


def test_only_a_true_npy_file_is_encoded_in_place() -> None:
    merged = concatenate_into_npy([np.arange(24, dtype=np.uint8).reshape(2, 3, 4)])
    assert merged is not None
    file = npy_file_of(merged)
    assert file is not None
    # a part of it, another shape of it, or it behind a damaged header: not that file
    assert npy_file_of(merged[1:]) is None
    assert npy_file_of(merged.reshape(6, 4)) is None  # same bytes, but the header says (2, 3, 4)
    assert encode_npy_base64(merged.reshape(6, 4)) == reference(merged.reshape(6, 4))
    file[10] ^= 1
    assert npy_file_of(merged) is None
    assert encode_npy_base64(merged) == reference(merged)
    # arrays that merely sit inside some uint8 buffer
    buf = np.zeros(1024, dtype=np.uint8)
    assert npy_file_of(buf[64:].reshape(-1, 8)) is None
    assert npy_file_of(np.arange(5)) is None


def test_chunks_that_do_not_fit_are_left_to_numpy() -> None:
    a = np.zeros((2, 3, 4), dtype=np.uint8)
    assert concatenate_into_npy([]) is None
    assert concatenate_into_npy([a, a.astype(np.uint16)]) is None
    assert concatenate_into_npy([a, np.zeros((2, 3, 5), dtype=np.uint8)]) is None
    assert concatenate_into_npy([a, np.zeros((2, 12), dtype=np.uint8)]) is None
    assert concatenate_into_npy([np.ma.masked_array(a)]) is None


def test_arrays_np_save_refuses_are_refused_alike() -> None:
    with pytest.raises(ValueError, match="allow_pickle"):
        encode_npy_base64(np.array([object()], dtype=object))
    masked = np.ma.masked_array(np.arange(4), mask=[0, 1, 0, 0])
    assert encode_npy_base64(masked) == reference(masked)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=200), st.integers(1, 6))
def test_decoding_round_trips_across_slice_boundaries(raw: bytes, slice_quads: int) -> None:
    text = base64.b64encode(raw).decode("ascii")
    original = npy._DECODE_SLICE
    npy._DECODE_SLICE = 4 * slice_quads  # many slices, padding in the last one
    try:
        for payload in (text, text.encode("ascii")):
            decoded = decode_npy_base64(payload)
            assert decoded.tobytes() == raw and decoded.flags.writeable
    finally:
        npy._DECODE_SLICE = original


@pytest.mark.parametrize(
    "payload, why",
    [
        ("QUJD" + "RA", "multiple of 4"),
        ("QUJDRA==QUJD", "padding"),
        ("QU JDRA=", "base64"),
        ("QUJ\u00e9", "non-ASCII"),
        ("QUJDRA=A", "base64"),
        ("QUJD!!!!", "base64"),
    ],
)
def test_decoding_is_strict(payload: str, why: str) -> None:
    original = npy._DECODE_SLICE
    npy._DECODE_SLICE = 4  # padding inside the payload also ends a slice early
    try:
        with pytest.raises(ValueError, match=why):
            decode_npy_base64(payload)
    finally:
        npy._DECODE_SLICE = original
    with pytest.raises(ValueError):
        decode_npy_base64(payload)
