"""Keys-only handoff: a completion's R3 as the ordered keys of its store objects.

A trainer on the engine's node can skip the array path (rows shipped every step, a
multi-MiB base64 ``.npy`` in the response) and read R3 straight from ``/dev/shm``:
a request that asks for ``routed_experts_format="keys"`` gets an :class:`R3Keys` handle,
which names the store, the R3 layout, the keys of the blocks covering the completion (full
KV blocks, then the terminal partial block) and which rows of them are the completion's.
:mod:`vllm_artifact.client.reader` materializes it with the store's integrity checks.

The handle is plain JSON (``to_json``/``from_json``), validated with pydantic, so any
language can read it; a handle from an untrusted peer can only name a store under a root
the reader accepts (the store's own root checks apply) and keys of fixed size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import numpy as np
import xxhash
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm_artifact.core.keys import KEY_NBYTES, Namespace, ObjectKey, keys_from_joined
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.errors import SchemaError

__all__ = [
    "KEYS_FORMAT",
    "R3_FORMAT_OPTION",
    "KeysContext",
    "R3Keys",
    "RowsDigest",
    "StoreAddress",
]

#: ``SamplingParams.extra_args`` key (HTTP: ``vllm_xargs``) choosing how R3 is returned.
R3_FORMAT_OPTION = "routed_experts_format"
#: The ``format`` tag of a handle; a reader refuses any other.
KEYS_FORMAT: Final = "vllm-artifact/r3-keys/v1"
_MAX_KEYS = 1 << 20  # 16M tokens at block size 16: far beyond any context length
_HexKey = Annotated[str, Field(pattern=rf"^[0-9a-f]{{{2 * KEY_NBYTES}}}$")]


class StoreAddress(BaseModel):
    """Where a handle's objects are. ``shm``: a store on this node, its root directory and its
    name under the root. ``mooncake``: a Mooncake Store, readable from any node, as its
    master's address (``root``), metadata service (``metadata``) and our key prefix there
    (``name``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["shm", "mooncake"] = "shm"
    root: str = Field(min_length=1, max_length=4096)
    name: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._-]+$")
    metadata: str | None = Field(default=None, min_length=1, max_length=4096)

    @model_validator(mode="after")
    def _backend_fields(self) -> StoreAddress:
        if (self.metadata is None) != (self.backend == "shm"):
            raise ValueError("a mooncake store address has a metadata service, a shm one none")
        return self

    def describe(self) -> str:
        """The address in words, for messages."""
        if self.backend == "shm":
            return f"{self.root}/{self.name}"
        return f"mooncake master {self.root}, prefix {self.name}"


@dataclass(frozen=True)
class KeysContext:
    """What the scheduler needs from rank zero to build handles: where the store is, and the
    model identity and layout that (with the weight version) make the keys' namespace."""

    store: StoreAddress
    model_id: str
    layout: R3Layout

    def namespace(self, weight_version: str) -> Namespace:
        return Namespace(self.model_id, self.layout, weight_version)


class RowsDigest:
    """xxh3-128 of a request's rows, fed step by step in token order (the engine), or at
    once (a reader checking what it materialized): :attr:`R3Keys.rows_xxh3`."""

    def __init__(self) -> None:
        self._hash = xxhash.xxh3_128()
        self.rows = 0

    def add(self, rows: np.ndarray) -> None:
        self._hash.update(np.ascontiguousarray(rows).data.cast("B"))
        self.rows += len(rows)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    @classmethod
    def of(cls, rows: np.ndarray) -> str:
        digest = cls()
        digest.add(rows)
        return digest.hexdigest()


class R3Keys(BaseModel):
    """One completion's R3 as store keys.

    ``keys[i]`` holds the rows of tokens ``[token_start + i * block_size, ...)``: every key
    but the last is a full block; the last holds ``last_block_tokens`` rows (a terminal
    partial block when fewer than ``block_size``). The completion's rows are tokens
    ``[first_row, first_row + num_rows)``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: Literal["vllm-artifact/r3-keys/v1"] = KEYS_FORMAT
    store: StoreAddress
    layout: str = Field(min_length=1, max_length=1 << 16)  # R3Layout.canonical()
    block_size: int = Field(ge=1)
    token_start: int = Field(ge=0)
    first_row: int = Field(ge=0)
    num_rows: int = Field(ge=0)
    keys: list[_HexKey] = Field(max_length=_MAX_KEYS)
    last_block_tokens: int = Field(ge=1)
    #: xxh3-128 (hex) of the rows the request's routing gave, in order (what the array path
    #: returns): a handle resolves to exactly these rows or not at all. A key names content
    #: by token hashes; another request may have published the same blocks first with other
    #: routing (nondeterministic kernels), and the store keeps the first.
    rows_xxh3: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")
    #: The same guarantee for a handle whose rows start at a block boundary (the usual: the
    #: whole prompt), checkable from the objects' 64-byte envelopes alone: xxh3-128 (hex) of
    #: the envelope checksums the store gives objects holding the request's rows
    #: (``core/objects_digest.py``). The engine sends one of the two.
    objects_xxh3: str | None = Field(default=None, pattern=r"^[0-9a-f]{32}$")

    @model_validator(mode="after")
    def _rows_within_keys(self) -> R3Keys:
        if self.token_start % self.block_size:
            raise ValueError("token_start must be a multiple of block_size")
        if self.first_row < self.token_start:
            raise ValueError("first_row lies before the first key's block")
        if self.last_block_tokens > self.block_size:
            raise ValueError("last_block_tokens exceeds block_size")
        covered = self.token_start + len(self.keys) * self.block_size
        if self.keys:
            covered -= self.block_size - self.last_block_tokens
        if self.first_row + self.num_rows > covered:
            raise ValueError(
                f"rows [{self.first_row}, {self.first_row + self.num_rows}) reach past the "
                f"{len(self.keys)} keys' blocks (up to token {covered})"
            )
        return self

    @classmethod
    def of(
        cls,
        *,
        store: StoreAddress,
        layout: str,
        block_size: int,
        token_start: int,
        first_row: int,
        num_rows: int,
        keys: list[ObjectKey],
        last_block_tokens: int,
        rows_xxh3: str | None = None,
        objects_xxh3: str | None = None,
        trusted: bool = False,
    ) -> R3Keys:
        """A handle from its parts; ``trusted=True`` (the engine's own, derived values) skips
        validation, which costs more than the rest for thousands of keys."""
        return (cls.model_construct if trusted else cls)(
            store=store,
            layout=layout,
            block_size=block_size,
            token_start=token_start,
            first_row=first_row,
            num_rows=num_rows,
            keys=[key.hex() for key in keys],
            last_block_tokens=last_block_tokens,
            rows_xxh3=rows_xxh3,
            objects_xxh3=objects_xxh3,
        )

    def object_keys(self) -> tuple[list[ObjectKey], int, int]:
        """The keys of the objects the completion's rows lie in (token order), the token
        their first object starts at, and how many rows those objects hold."""
        if not self.num_rows:
            return [], self.first_row, 0
        bs = self.block_size
        first = (self.first_row - self.token_start) // bs
        last = -(-(self.first_row + self.num_rows - self.token_start) // bs)
        start = self.token_start + first * bs
        held = (last - first) * bs
        if last == len(self.keys):
            held -= bs - self.last_block_tokens
        return keys_from_joined(bytes.fromhex("".join(self.keys[first:last]))), start, held

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, source: str | bytes | Mapping[str, Any]) -> R3Keys:
        """Parse and validate a handle (its JSON text, or that text already parsed);
        anything malformed is a :class:`SchemaError`."""
        try:
            if isinstance(source, Mapping):
                return cls.model_validate(source)
            return cls.model_validate_json(source)
        except ValidationError as err:
            raise SchemaError(f"not a vllm-artifact R3 keys handle: {_first_error(err)}") from None

    # ------------------------------------------------------------- transport

    def to_transport(self) -> np.ndarray:
        """The handle as vLLM's routed-experts field carries it between processes: a
        ``[1, n]`` uint8 array of the JSON (R3 rows are 3-D, so the two never mix)."""
        return np.frombuffer(self.to_json().encode(), dtype=np.uint8).reshape(1, -1)

    @classmethod
    def is_transport(cls, value: object) -> bool:
        return (
            isinstance(value, np.ndarray)
            and value.ndim == 2
            and value.dtype == np.uint8
            and value.shape[0] == 1
            and bytes(value[0, :11]) == b'{"format":"'
        )

    @classmethod
    def from_transport(cls, value: np.ndarray) -> R3Keys:
        return cls.from_json(value[0].tobytes())


def _first_error(err: ValidationError) -> str:
    error = err.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "handle"
    return f"{where}: {error['msg']} ({err.error_count()} problem(s))"
