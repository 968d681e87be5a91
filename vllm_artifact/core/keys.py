"""Object keys: a namespace plus a KV-compatible block hash.

KV block hashes (``request.block_hashes``) identify token content and its
prefix chain, but not the model, the R3 layout or the weights. A key therefore
mixes a :class:`Namespace` (model identity + layout + weight version) with the
caller-supplied block hash, so two models on one root, or one model before and
after a weight update, can never read each other's objects.

Keys are 16-byte keyed BLAKE2b digests: fixed length, uniformly distributed
(the store's hash index relies on that), and collision resistant even when a
deployment runs prefix caching with a non-cryptographic block hash. Their hex
form is a safe file name (no path characters, 32 chars). Full-block keys and
terminal partial-block ("tail") keys are domain-separated, and the tail key also
binds its token count, so a tail can never be confused with a full block.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import NewType, cast

import numpy as np

from vllm_artifact.core.schema import R3Layout
from vllm_artifact.errors import SchemaError, WeightVersionError

__all__ = [
    "DEFAULT_WEIGHT_VERSION",
    "KEY_NBYTES",
    "KeyCache",
    "Namespace",
    "ObjectKey",
    "check_weight_version",
    "full_block_key",
    "full_block_keys",
    "keys_from_joined",
    "keys_to_words",
    "object_key",
    "tail_block_key",
]

#: The weight version of an engine whose weights were never updated through vLLM's
#: weight-version API.
DEFAULT_WEIGHT_VERSION = "default"
#: Size of an object key in bytes.
KEY_NBYTES = 16
_MAX_BLOCK_HASH_NBYTES = 1024
_MAX_FIELD_CHARS = 4096
_PERSON_NAMESPACE = b"vart-r3-ns-v1"
_PERSON_FULL = b"vart-r3-full-v1"
_PERSON_TAIL = b"vart-r3-tail-v1"


#: A 16-byte object key. Plain ``bytes`` at run time (a type for the checker only): an engine
#: keeps tens of thousands of keys (its key cache, its pins, its queued blocks), and instances
#: of a ``bytes`` subclass, even one with empty ``__slots__``, are objects the cyclic garbage
#: collector tracks and walks in every collection of their generation; ``bytes`` are not.
ObjectKey = NewType("ObjectKey", bytes)


def object_key(digest: bytes) -> ObjectKey:
    """``digest`` as a key, checked to be :data:`KEY_NBYTES` bytes (for bytes from outside)."""
    if len(digest) != KEY_NBYTES:
        raise SchemaError(f"an object key must be {KEY_NBYTES} bytes, got {len(digest)}")
    return ObjectKey(bytes(digest))


def keys_from_joined(joined: bytes) -> list[ObjectKey]:
    """The keys of a concatenation of keys (one length check for all of them: thousands of
    keys are read back per request on the keys path)."""
    if len(joined) % KEY_NBYTES:
        raise SchemaError(f"{len(joined)} bytes are not a whole number of keys")
    return [ObjectKey(joined[i : i + KEY_NBYTES]) for i in range(0, len(joined), KEY_NBYTES)]


def _field(value: str, what: str) -> bytes:
    if not isinstance(value, str) or not value or len(value) > _MAX_FIELD_CHARS:
        raise SchemaError(f"Namespace.{what} must be a non-empty str of <= {_MAX_FIELD_CHARS}")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(f"Namespace.{what} is not valid Unicode (a lone surrogate)") from None
    return len(raw).to_bytes(4, "little") + raw


def check_weight_version(value: object) -> str:
    """``value`` if our keys can carry it as a weight version, else :class:`WeightVersionError`
    saying what to send. vLLM accepts any string; checked where vLLM is handed one (the
    weight_version hook), so a bad one is refused before the engine records it."""
    if not isinstance(value, str):
        problem = f"must be a string, got {type(value).__name__}"
    elif not value:
        problem = "must not be empty"
    elif len(value) > _MAX_FIELD_CHARS:
        problem = f"has {len(value)} characters, at most {_MAX_FIELD_CHARS} are allowed"
    else:
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError as error:
            problem = f"is not valid Unicode ({error.reason} at position {error.start})"
    raise WeightVersionError(
        f"weight version {problem}; R3 objects are keyed by it. Send a non-empty UTF-8 string "
        f"of at most {_MAX_FIELD_CHARS} characters (e.g. the trainer's step); the engine "
        "keeps its current weight version."
    )


@dataclass(frozen=True)
class Namespace:
    """Everything that must differ for R3 of one block hash to differ.

    ``weight_version`` is the engine's weight version string (vLLM's
    weight-version API); it must change on every in-place weight update.
    """

    model_id: str
    layout: R3Layout
    weight_version: str

    def __post_init__(self) -> None:
        _field(self.model_id, "model_id")
        _field(self.weight_version, "weight_version")
        if not isinstance(self.layout, R3Layout):
            raise SchemaError("Namespace.layout must be an R3Layout")

    @cached_property
    def digest(self) -> bytes:
        """32-byte stable digest of the namespace (length-prefixed fields)."""
        blob = (
            _field(self.model_id, "model_id")
            + _field(self.layout.canonical(), "layout")
            + _field(self.weight_version, "weight_version")
        )
        return hashlib.blake2b(blob, digest_size=32, person=_PERSON_NAMESPACE).digest()

    @property
    def short(self) -> str:
        """Short hex id for logs and store names."""
        return self.digest[:8].hex()

    def describe(self) -> str:
        """One-line human description for the startup log."""
        return (
            f"model={self.model_id!r} weight_version={self.weight_version!r} "
            f"layout=({self.layout.canonical()}) ns={self.short}"
        )


def _check_hash(block_hash: bytes) -> bytes:
    if not isinstance(block_hash, bytes | bytearray | memoryview):
        raise SchemaError(f"block hash must be bytes, got {type(block_hash).__name__}")
    if not 1 <= len(block_hash) <= _MAX_BLOCK_HASH_NBYTES:
        raise SchemaError(f"block hash must be 1..{_MAX_BLOCK_HASH_NBYTES} bytes")
    return bytes(block_hash)


def full_block_key(namespace: Namespace, block_hash: bytes) -> ObjectKey:
    """Key of the object holding the rows of one full KV block."""
    return ObjectKey(
        hashlib.blake2b(
            _check_hash(block_hash),
            digest_size=KEY_NBYTES,
            key=namespace.digest,
            person=_PERSON_FULL,
        ).digest()
    )


def full_block_keys(namespace: Namespace, block_hashes: Iterable[bytes]) -> list[ObjectKey]:
    """Keys of many full blocks, in order (a request's ``block_hashes``); the same keys as
    :func:`full_block_key`, made from one keyed hash state copied per key (the worker makes
    tens of keys per engine step)."""
    keyed = _full_block_hasher(namespace.digest)
    out = []
    for block_hash in block_hashes:
        if type(block_hash) is not bytes or not 1 <= len(block_hash) <= _MAX_BLOCK_HASH_NBYTES:
            block_hash = _check_hash(block_hash)
        state = keyed.copy()
        state.update(block_hash)
        out.append(state.digest())  # 16 bytes by construction
    return cast("list[ObjectKey]", out)


@lru_cache(maxsize=16)
def _full_block_hasher(namespace_digest: bytes) -> hashlib.blake2b:
    """BLAKE2b keyed with a namespace, before any data: copied for each full-block key."""
    return hashlib.blake2b(digest_size=KEY_NBYTES, key=namespace_digest, person=_PERSON_FULL)


class KeyCache:
    """Full-block keys of the block hashes seen last, under one namespace.

    A prefix hit names KV blocks an earlier request computed, whose keys rank zero made when
    it published them; a request whose prompt shares a 32K-token prefix (a repeated system
    prompt, the samples of one prompt, the next turn of a conversation) would otherwise key
    2048 hashes again on the engine's step thread. Keys are a pure function of namespace and
    hash, so the cache changes no result; it keeps up to ``max_entries`` hashes (about 170
    bytes each, 11 MiB at the default; more only while one request alone has more) and drops
    the older half when full.
    """

    def __init__(self, max_entries: int = 1 << 16) -> None:
        if max_entries < 2:
            raise ValueError("KeyCache.max_entries must be at least 2")
        self._max = max_entries
        self._digest = b""  # the namespace the cached keys were made under
        self._keys: dict[bytes, ObjectKey] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def keys_of(self, namespace: Namespace, block_hashes: list[bytes]) -> list[ObjectKey]:
        """:func:`full_block_keys` of ``block_hashes`` (``bytes``), cached."""
        if namespace.digest != self._digest:
            self._keys.clear()
            self._digest = namespace.digest
        cached = self._keys
        if len(block_hashes) == 1:  # the usual decode step: one new block
            key = cached.get(block_hashes[0])
            if key is None:
                (key,) = full_block_keys(namespace, block_hashes)
                if len(cached) >= self._max:
                    self._make_room(1)
                cached[block_hashes[0]] = key
            return [key]
        keys = list(map(cached.get, block_hashes))
        if None not in keys:
            return keys  # type: ignore[return-value]  # no None in it
        missing = [h for h, key in zip(block_hashes, keys, strict=True) if key is None]
        made = full_block_keys(namespace, missing)
        self._make_room(len(made))
        cached.update(zip(missing, made, strict=True))
        if len(made) == len(keys):
            return made
        fresh = iter(made)
        return [key if key is not None else next(fresh) for key in keys]

    def _make_room(self, count: int) -> None:
        """If ``count`` more would not fit, drop the oldest (insertion order): at least half,
        so trimming is rare, and enough that ``count`` fits if it can."""
        cached = self._keys
        excess = len(cached) + count - self._max
        if excess > 0:
            drop = min(len(cached), max(excess, len(cached) // 2))
            for old in list(itertools.islice(cached, drop)):
                del cached[old]


def tail_block_key(namespace: Namespace, tail_hash: bytes, num_tokens: int) -> ObjectKey:
    """Key of a terminal partial block.

    ``tail_hash`` is computed by the caller with the KV cache's own hash
    function from the parent block hash, the tail tokens and the same extra
    keys; ``num_tokens`` is the number of rows in the object (bound into the
    key, and validated again on read through the envelope).
    """
    if not isinstance(num_tokens, int) or not 1 <= num_tokens <= namespace.layout.block_size:
        raise SchemaError(
            f"tail num_tokens={num_tokens!r} must be in 1..{namespace.layout.block_size}"
        )
    payload = num_tokens.to_bytes(4, "little") + _check_hash(tail_hash)
    return ObjectKey(
        hashlib.blake2b(
            payload, digest_size=KEY_NBYTES, key=namespace.digest, person=_PERSON_TAIL
        ).digest()
    )


def keys_to_words(keys: Sequence[bytes]) -> np.ndarray:
    """Keys as a ``[n, 2]`` little-endian uint64 array (for vectorized lookups)."""
    if set(map(len, keys)) - {KEY_NBYTES}:
        raise SchemaError(f"every key must be {KEY_NBYTES} bytes")
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), 2)
