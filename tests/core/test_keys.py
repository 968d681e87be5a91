"""Keys: namespace separation, full vs tail keys, safety as storage names."""

from __future__ import annotations

import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_artifact.core import (
    Namespace,
    ObjectKey,
    R3Layout,
    full_block_key,
    full_block_keys,
    tail_block_key,
)
from vllm_artifact.core.keys import keys_to_words
from vllm_artifact.errors import SchemaError

LAYOUT = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16)
NS = Namespace("m", LAYOUT, "v1")
HEX = re.compile(r"[0-9a-f]{32}")


@given(st.binary(min_size=1, max_size=128))
def test_key_is_bounded_and_name_safe(block_hash: bytes) -> None:
    key = full_block_key(NS, block_hash)
    assert isinstance(key, ObjectKey) and len(key) == 16
    assert HEX.fullmatch(key.name)
    assert "/" not in key.name and key.name not in {".", ".."}


@given(st.binary(min_size=1, max_size=64), st.binary(min_size=1, max_size=64))
def test_distinct_hashes_distinct_keys(a: bytes, b: bytes) -> None:
    assert (full_block_key(NS, a) == full_block_key(NS, b)) == (a == b)


@given(st.binary(min_size=1, max_size=64), st.integers(1, 16))
def test_tail_keys_never_equal_full_keys(h: bytes, n: int) -> None:
    tail = tail_block_key(NS, h, n)
    assert tail != full_block_key(NS, h)
    assert tail == tail_block_key(NS, h, n)
    if n > 1:
        assert tail != tail_block_key(NS, h, n - 1)


def test_namespace_separates_model_layout_and_weights() -> None:
    h = b"\x01" * 32
    other_layout = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=32)
    spaces = [
        NS,
        Namespace("m2", LAYOUT, "v1"),
        Namespace("m", LAYOUT, "v2"),
        Namespace("m", other_layout, "v1"),
    ]
    keys = {full_block_key(ns, h) for ns in spaces}
    assert len(keys) == 4
    # Length prefixes: moving a character between fields changes the digest.
    assert Namespace("ab", LAYOUT, "c").digest != Namespace("a", LAYOUT, "bc").digest


def test_namespace_digest_is_stable() -> None:
    again = Namespace("m", R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16), "v1")
    assert again.digest == NS.digest and len(NS.digest) == 32
    # A fixed vector: keys must not change between releases (stores outlive engines).
    assert full_block_key(NS, b"abc").hex() == full_block_key(again, b"abc").hex()
    assert "ns=" in NS.describe() and NS.short == NS.digest[:8].hex()


def test_full_block_keys_matches_single() -> None:
    hashes: list[bytes] = [bytes([i]) * (1 + 7 * i) for i in range(10)]
    hashes += [bytearray(b"ba" * 16), memoryview(b"mv" * 16)]  # type: ignore[list-item]
    other = Namespace("other-model", NS.layout, NS.weight_version)
    for ns in (NS, other, NS):  # the keyed hash state is cached per namespace
        keys = full_block_keys(ns, hashes)
        assert keys == [full_block_key(ns, h) for h in hashes]
        assert all(type(key) is ObjectKey and len(key) == 16 for key in keys)
    assert set(full_block_keys(NS, hashes)).isdisjoint(full_block_keys(other, hashes))
    for bad in (b"", b"x" * 1025, "str"):
        with pytest.raises(SchemaError):
            full_block_keys(NS, [bad])  # type: ignore[list-item]


def test_key_validation() -> None:
    with pytest.raises(SchemaError):
        ObjectKey(b"short")
    with pytest.raises(SchemaError):
        full_block_key(NS, b"")
    with pytest.raises(SchemaError):
        full_block_key(NS, "text")  # type: ignore[arg-type]
    with pytest.raises(SchemaError):
        tail_block_key(NS, b"x", 0)
    with pytest.raises(SchemaError):
        tail_block_key(NS, b"x", 17)
    with pytest.raises(SchemaError):
        Namespace("", LAYOUT, "v1")
    with pytest.raises(SchemaError):
        Namespace("m", LAYOUT, "")
    with pytest.raises(SchemaError):
        keys_to_words([b"x" * 15, b"y" * 17])


def test_key_pickles_and_words_round_trip() -> None:
    keys = full_block_keys(NS, [b"a", b"b"])
    assert pickle.loads(pickle.dumps(keys)) == keys
    assert type(pickle.loads(pickle.dumps(keys[0]))) is ObjectKey
    words = keys_to_words(keys)
    assert words.shape == (2, 2)
    assert words.tobytes() == b"".join(keys)


def test_from_joined_gives_the_keys_back() -> None:
    keys = full_block_keys(NS, [b"a", b"b", b"c"])
    split = ObjectKey.from_joined(b"".join(keys))
    assert split == keys and all(type(key) is ObjectKey for key in split)
    assert ObjectKey.from_joined(b"") == []
    with pytest.raises(SchemaError):
        ObjectKey.from_joined(b"x" * 17)
