"""R3 schema: what one routing row looks like and how it is stored.

An R3 array has shape ``[tokens, num_layers, top_k]``: one row per executed
token, one entry per hidden layer, the router's top-k expert ids (logical ids,
before any expert-parallel remapping). The dtype follows one rule: ``uint8``
when the model has at most 256 experts, ``uint16`` otherwise, so a 32K-token
DeepSeek-V3 sample stays at 464 B/token.

Dense (non-MoE) layers have no router; their entries are 0, which a trainer
cannot tell from expert 0. The layout therefore names the dense layers
explicitly (``dense_layers`` / ``moe_layer_mask``); the integration ships that
mask next to every array.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from vllm_artifact.errors import SchemaError

__all__ = ["DTYPE_CODES", "MAX_LAYERS", "R3Layout", "dtype_for_experts"]

#: Largest expert count uint8 can hold (ids 0..255).
_UINT8_EXPERTS = 256
#: Largest expert count representable at all (ids 0..65535).
_UINT16_EXPERTS = 65536
#: Upper bound on layers per row; keeps the store superblock fixed-size.
MAX_LAYERS = 4096
#: On-disk dtype codes (stored in envelopes and the store superblock).
DTYPE_CODES: dict[str, int] = {"uint8": 1, "uint16": 2}


def dtype_for_experts(num_experts: int) -> np.dtype[np.unsignedinteger]:
    """Return the R3 dtype for a model with ``num_experts`` routed experts."""
    if not 1 <= num_experts <= _UINT16_EXPERTS:
        raise SchemaError(
            f"num_experts={num_experts} is outside 1..{_UINT16_EXPERTS}; R3 ids must fit in uint16."
        )
    return np.dtype(np.uint8) if num_experts <= _UINT8_EXPERTS else np.dtype(np.uint16)


@dataclass(frozen=True)
class R3Layout:
    """Geometry of R3 rows for one model and one KV block size.

    ``num_layers`` counts every layer that appears in a row (vLLM's capturer
    writes all hidden layers; dense ones stay 0). ``dense_layers`` lists the
    indices of layers without a router. ``block_size`` is the KV-cache block
    size in tokens: one store object holds the rows of one KV block.
    """

    num_layers: int
    top_k: int
    num_experts: int
    block_size: int
    dense_layers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("num_layers", "top_k", "num_experts", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SchemaError(f"R3Layout.{name} must be a positive int, got {value!r}")
        if self.num_layers > MAX_LAYERS:
            raise SchemaError(f"R3Layout.num_layers={self.num_layers} exceeds {MAX_LAYERS}")
        if self.top_k > self.num_experts:
            raise SchemaError(f"R3Layout.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        dtype_for_experts(self.num_experts)
        dense = tuple(self.dense_layers)
        if any(not isinstance(i, int) or isinstance(i, bool) for i in dense):
            raise SchemaError("R3Layout.dense_layers must hold ints")
        if list(dense) != sorted(set(dense)) or any(not 0 <= i < self.num_layers for i in dense):
            raise SchemaError(
                "R3Layout.dense_layers must be sorted, unique layer indices in "
                f"0..{self.num_layers - 1}, got {dense!r}"
            )
        if len(dense) == self.num_layers:
            raise SchemaError("R3Layout has no MoE layer: every layer is dense")
        object.__setattr__(self, "dense_layers", dense)

    @cached_property
    def dtype(self) -> np.dtype[np.unsignedinteger]:
        """``uint8`` for <= 256 experts, else ``uint16``."""
        return dtype_for_experts(self.num_experts)

    @cached_property
    def dtype_code(self) -> int:
        """Small integer naming the dtype in envelopes."""
        return DTYPE_CODES[self.dtype.name]

    @cached_property
    def row_shape(self) -> tuple[int, int]:
        """Shape of one token's row: ``(num_layers, top_k)``."""
        return (self.num_layers, self.top_k)

    @cached_property
    def row_nbytes(self) -> int:
        """Bytes of one token's row."""
        return self.num_layers * self.top_k * self.dtype.itemsize

    @cached_property
    def block_nbytes(self) -> int:
        """Bytes of one full block (the largest object)."""
        return self.block_size * self.row_nbytes

    @cached_property
    def moe_layer_mask(self) -> np.ndarray:
        """Bool ``[num_layers]``: True where the layer has a router.

        Entries of False layers are always 0 and are *not* expert ids.
        """
        mask = np.ones(self.num_layers, dtype=bool)
        mask[list(self.dense_layers)] = False
        mask.setflags(write=False)
        return mask

    def canonical(self) -> str:
        """Stable text form, used in key namespaces and store headers."""
        dense = ",".join(str(i) for i in self.dense_layers)
        return (
            f"r3-layout/v1;layers={self.num_layers};top_k={self.top_k};"
            f"experts={self.num_experts};block={self.block_size};dense=[{dense}];"
            f"dtype={self.dtype.name}"
        )

    def empty(self, num_tokens: int) -> np.ndarray:
        """Uninitialized array for ``num_tokens`` rows."""
        return np.empty((num_tokens, self.num_layers, self.top_k), dtype=self.dtype)

    def check_rows(self, rows: object, *, what: str = "rows") -> np.ndarray:
        """Check dtype and shape of ``rows``; return it C-contiguous.

        Cheap (no pass over the data): expert-id ranges are checked by
        :meth:`check_ids`, which callers use where the source is untrusted.
        """
        if not isinstance(rows, np.ndarray):
            raise SchemaError(f"{what} must be a numpy array, got {type(rows).__name__}")
        if rows.dtype != self.dtype:
            raise SchemaError(
                f"{what} have dtype {rows.dtype}, layout wants {self.dtype} "
                f"({self.num_experts} experts)"
            )
        if rows.ndim != 3 or rows.shape[1:] != self.row_shape:
            raise SchemaError(
                f"{what} have shape {rows.shape}, layout wants [tokens, {self.num_layers}, "
                f"{self.top_k}]"
            )
        return np.ascontiguousarray(rows)

    def check_ids(self, rows: np.ndarray, *, what: str = "rows") -> None:
        """Check expert ids are < num_experts and dense layers are all 0."""
        if rows.size == 0:
            return
        moe = rows[:, self.moe_layer_mask, :]
        if moe.size and int(moe.max()) >= self.num_experts:
            raise SchemaError(
                f"{what} hold expert id {int(moe.max())} >= num_experts={self.num_experts}"
            )
        if self.dense_layers and rows[:, list(self.dense_layers), :].any():
            raise SchemaError(f"{what} have non-zero entries in dense layers")
