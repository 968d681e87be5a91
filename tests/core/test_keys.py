"""Keys: namespace separation, full vs tail keys, safety as storage names."""

from __future__ import annotations

import gc
import hashlib
import pickle
from typing import Any

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
from vllm_artifact.core.keys import KeyCache, keys_from_joined, keys_to_words, object_key
from vllm_artifact.errors import SchemaError

LAYOUT = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16)
NS = Namespace("m", LAYOUT, "v1")


@given(st.binary(min_size=1, max_size=128))
def test_key_is_sixteen_plain_bytes(block_hash: bytes) -> None:
    key = full_block_key(NS, block_hash)
    assert type(key) is bytes and len(key) == 16


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
    assert "ns=" in NS.describe() and NS.short == NS.digest[:8].hex()


# Known-answer vectors. Stores outlive engines (a restarted engine, a reader of another
# release, a keys handle sent elsewhere), so the key of a block must never change without a
# store format bump. Each case is (model id, layout, its canonical text, weight version, block
# hash, tail token count or None for a full block, namespace digest, key): the hex literals
# were derived once from the documented derivation (docs/store.md "Keys") and pin it; the
# test also derives them again below with hashlib alone.
UINT16_LAYOUT = R3Layout(num_layers=6, top_k=4, num_experts=300, block_size=32, dense_layers=(1,))
LAYOUT_TEXT = "r3-layout/v2;layers=4;top_k=2;experts=8;block=16;dense=[];dtype=uint8;dense_mark=255"
UINT16_TEXT = (
    "r3-layout/v2;layers=6;top_k=4;experts=300;block=32;dense=[1];dtype=uint16;dense_mark=65535"
)
NS_DIGEST = "12fe715436ee016a0e8d45e8ff172496abd3da94758ecb1695c75698f0e79bb6"
UINT16_NS_DIGEST = "29a2a57b9f78eaa1395828d71555afe3bc01e01425f53e6f6ca58bfd5a490ed7"
COUNTING = bytes(range(32))  # a 32-byte block hash, like vLLM's sha256 block hashes
KNOWN_KEYS = [
    ("m", LAYOUT, LAYOUT_TEXT, "v1", b"abc", None, NS_DIGEST, "d75ac336a554624ed2aff95456c826c6"),
    ("m", LAYOUT, LAYOUT_TEXT, "v1", COUNTING, None, NS_DIGEST, "acd7c857565b6539d472a8820e3976e2"),
    ("m", LAYOUT, LAYOUT_TEXT, "v1", b"abc", 5, NS_DIGEST, "0c53ff2f31c25d1e7da3dc7e4be15fa6"),
    ("m", LAYOUT, LAYOUT_TEXT, "v1", b"abc", 16, NS_DIGEST, "a85963b04ffd93a46b54cdbb270ed0b9"),
    (
        "Qwen/Qwen3-30B-A3B",
        UINT16_LAYOUT,
        UINT16_TEXT,
        "step-7",
        COUNTING,
        None,
        UINT16_NS_DIGEST,
        "4cd1dbc535a59bccf0e35d3cee7ddf21",
    ),
    (
        "Qwen/Qwen3-30B-A3B",
        UINT16_LAYOUT,
        UINT16_TEXT,
        "step-7",
        COUNTING,
        31,
        UINT16_NS_DIGEST,
        "20e271b9142013697f05ef372c28f902",
    ),
]


def documented_key(
    model_id: str, layout_text: str, weight_version: str, block_hash: bytes, tail: int | None
) -> tuple[bytes, bytes]:
    """(namespace digest, key) by the documented derivation, with hashlib alone: the
    namespace digest is a 32-byte BLAKE2b of its fields, each prefixed by its UTF-8 length
    (4 bytes, little-endian); a key is a 16-byte BLAKE2b of the block hash keyed by that
    digest, full and tail keys told apart by their personalization, the tail key binding its
    token count (4 bytes, little-endian, before the hash)."""
    fields = b"".join(
        len(raw).to_bytes(4, "little") + raw
        for raw in (text.encode() for text in (model_id, layout_text, weight_version))
    )
    digest = hashlib.blake2b(fields, digest_size=32, person=b"vart-r3-ns-v1").digest()
    if tail is None:
        data, person = block_hash, b"vart-r3-full-v1"
    else:
        data, person = tail.to_bytes(4, "little") + block_hash, b"vart-r3-tail-v1"
    return digest, hashlib.blake2b(data, digest_size=16, key=digest, person=person).digest()


@pytest.mark.parametrize(
    "case",
    KNOWN_KEYS,
    ids=lambda case: f"{'full' if case[5] is None else f'tail{case[5]}'}-{case[3]}-{len(case[4])}B",
)
def test_keys_equal_known_answers(case: tuple[Any, ...]) -> None:
    model_id, layout, layout_text, version, block_hash, tail, ns_digest, key = case
    assert layout.canonical() == layout_text  # the layout's text is part of the namespace
    namespace = Namespace(model_id, layout, version)
    made = (
        full_block_key(namespace, block_hash)
        if tail is None
        else tail_block_key(namespace, block_hash, tail)
    )
    assert namespace.digest.hex() == ns_digest
    assert made.hex() == key
    assert documented_key(model_id, layout_text, version, block_hash, tail) == (
        bytes.fromhex(ns_digest),
        bytes.fromhex(key),
    )
    if tail is None:  # the batched and cached paths give the same bytes
        assert full_block_keys(namespace, [block_hash]) == [made]
        assert KeyCache().keys_of(namespace, [block_hash, b"other"])[0] == made


def test_full_block_keys_matches_single() -> None:
    hashes: list[bytes] = [bytes([i]) * (1 + 7 * i) for i in range(10)]
    hashes += [bytearray(b"ba" * 16), memoryview(b"mv" * 16)]  # type: ignore[list-item]
    other = Namespace("other-model", NS.layout, NS.weight_version)
    for ns in (NS, other, NS):  # the keyed hash state is cached per namespace
        keys = full_block_keys(ns, hashes)
        assert keys == [full_block_key(ns, h) for h in hashes]
        assert all(type(key) is bytes and len(key) == 16 for key in keys)
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
        object_key(b"short")
    assert object_key(bytearray(16)) == bytes(16)
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
    assert type(pickle.loads(pickle.dumps(keys[0]))) is bytes
    words = keys_to_words(keys)
    assert words.shape == (2, 2)
    assert words.tobytes() == b"".join(keys)


def test_from_joined_gives_the_keys_back() -> None:
    keys = full_block_keys(NS, [b"a", b"b", b"c"])
    split = keys_from_joined(b"".join(keys))
    assert split == keys and all(type(key) is bytes for key in split)
    assert keys_from_joined(b"") == []
    with pytest.raises(SchemaError):
        keys_from_joined(b"x" * 17)


def test_keys_are_not_objects_the_garbage_collector_tracks() -> None:
    """An engine keeps tens of thousands of keys (key cache, pins, queued blocks): each would
    otherwise be walked by every collection of its generation."""
    cache = KeyCache()
    made = [
        full_block_key(NS, b"a"),
        *full_block_keys(NS, [b"b", b"c"]),
        *cache.keys_of(NS, [b"d", b"e"]),
        *cache.keys_of(NS, [b"f"]),
        tail_block_key(NS, b"g", 3),
        *keys_from_joined(bytes(32)),
        object_key(bytes(16)),
    ]
    assert [gc.is_tracked(key) for key in made] == [False] * len(made)
    assert not gc.is_tracked(cache._keys)  # a dict of bytes alone
