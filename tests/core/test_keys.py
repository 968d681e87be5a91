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
from vllm_artifact.core import keys as keys_module
from vllm_artifact.core.keys import KeyCache, keys_to_words
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


@given(
    st.lists(
        st.lists(st.integers(0, 40), min_size=1, max_size=12).map(
            lambda ids: [i.to_bytes(32, "little") for i in ids]
        ),
        min_size=1,
        max_size=20,
    ),
    st.integers(2, 16),
)
def test_key_cache_gives_the_keys_full_block_keys_gives(
    batches: list[list[bytes]], max_entries: int
) -> None:
    """Any mix of cached and new hashes, in order, with the cache trimmed along the way."""
    cache = KeyCache(max_entries=max_entries)
    largest = 0
    for batch in batches:
        assert cache.keys_of(NS, batch) == full_block_keys(NS, batch)
        largest = max(largest, len(batch))
        assert len(cache) <= max(max_entries, largest)


def test_key_cache_keys_a_hash_once_and_follows_the_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made: list[int] = []
    real = keys_module.full_block_keys

    def counting(namespace: Namespace, block_hashes: list[bytes]) -> list[ObjectKey]:
        made.append(len(block_hashes))
        return real(namespace, block_hashes)

    monkeypatch.setattr(keys_module, "full_block_keys", counting)
    cache = KeyCache()
    prefix = [i.to_bytes(32, "little") for i in range(2048)]  # a 32K-token prompt
    assert cache.keys_of(NS, prefix) == real(NS, prefix)
    assert cache.keys_of(NS, [*prefix, b"next turn"]) == real(NS, [*prefix, b"next turn"])
    assert made == [2048, 1]  # the second request keys only its own block
    updated = Namespace(NS.model_id, NS.layout, "v2")  # a weight update
    assert cache.keys_of(updated, prefix[:3]) == real(updated, prefix[:3])
    assert made[-1] == 3 and len(cache) == 3


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
