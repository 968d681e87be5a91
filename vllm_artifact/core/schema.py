"""R3 schema: what one routing row looks like and how it is stored.

An R3 array has shape ``[tokens, num_layers, top_k]``: one row per executed
token, one entry per hidden layer, the router's top-k expert ids (logical ids,
before any expert-parallel remapping). The dtype follows one rule: ``uint8``
when the model has at most 256 experts, ``uint16`` otherwise, so a 32K-token
DeepSeek-V3 sample stays at 464 B/token.

Dense (non-MoE) layers have no router. vLLM leaves their entries 0, which a
trainer cannot tell from expert 0; here every entry of a dense layer holds the
*dense mark*, the dtype's largest value (255 / 65535), which no routing row can
hold: a token's top-k ids are distinct, so for top-k >= 2 a routed row never
repeats one id, and for top-1 models the dtype rule leaves the largest value
unused (a top-1 model with exactly 256 experts gets ``uint16``). A consumer
therefore finds dense layers from the array alone
(``vllm_artifact.client.dense_layers``), and a trainer that indexes a router
with a dense entry by mistake fails instead of silently using expert 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from vllm_artifact.core.recycled_arrays import RecycledArrays, empty
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


def dtype_for_experts(num_experts: int, top_k: int) -> np.dtype[np.unsignedinteger]:
    """The R3 dtype for ``num_experts`` routed experts and top-``top_k`` routing: the smallest
    that holds every id and leaves the largest value free to mark dense layers."""
    if not 1 <= num_experts <= _UINT16_EXPERTS:
        raise SchemaError(
            f"num_experts={num_experts} is outside 1..{_UINT16_EXPERTS}; R3 ids must fit in uint16."
        )
    for dtype, capacity in ((np.uint8, _UINT8_EXPERTS), (np.uint16, _UINT16_EXPERTS)):
        # With top-k >= 2 the mark (all k entries equal) cannot be a routed row even when
        # the largest value is a valid id.
        if num_experts < capacity or (num_experts == capacity and top_k >= 2):
            return np.dtype(dtype)
    raise SchemaError(
        f"{num_experts} experts with top-1 routing leave no uint16 value to mark dense layers"
    )


_CANONICAL_RE = re.compile(
    r"r3-layout/v2;layers=(?P<layers>\d{1,6});top_k=(?P<top_k>\d{1,6});"
    r"experts=(?P<experts>\d{1,9});block=(?P<block>\d{1,9});dense=\[(?P<dense>[\d,]{0,100000})\];"
    r"dtype=\w+;dense_mark=\d+"
)


@dataclass(frozen=True)
class R3Layout:
    """Geometry of R3 rows for one model and one KV block size.

    ``num_layers`` counts every layer that appears in a row (vLLM's capturer
    writes all hidden layers). ``dense_layers`` lists the indices of layers
    without a router; their entries hold :attr:`dense_mark`. ``block_size`` is the KV-cache block
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
        dtype_for_experts(self.num_experts, self.top_k)
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
        """``uint8`` for <= 256 experts, else ``uint16`` (see :func:`dtype_for_experts`)."""
        return dtype_for_experts(self.num_experts, self.top_k)

    @cached_property
    def dense_mark(self) -> int:
        """The value of every entry of a dense layer: the dtype's largest, never a routed row."""
        return int(np.iinfo(self.dtype).max)

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

        Entries of False layers are :attr:`dense_mark`, *not* expert ids.
        """
        mask = np.ones(self.num_layers, dtype=bool)
        mask[list(self.dense_layers)] = False
        mask.setflags(write=False)
        return mask

    def canonical(self) -> str:
        """Stable text form, used in key namespaces and store headers."""
        dense = ",".join(str(i) for i in self.dense_layers)
        return (
            f"r3-layout/v2;layers={self.num_layers};top_k={self.top_k};"
            f"experts={self.num_experts};block={self.block_size};dense=[{dense}];"
            f"dtype={self.dtype.name};dense_mark={self.dense_mark}"
        )

    @classmethod
    def from_canonical(cls, text: str) -> R3Layout:
        """The layout :meth:`canonical` wrote (a keys handle names its layout so; a reader of a
        store without a header of its own, such as Mooncake, takes it from there)."""
        match = _CANONICAL_RE.fullmatch(text) if isinstance(text, str) else None
        if match is None:
            raise SchemaError(f"not an R3 layout: {text!r}")
        dense = match["dense"]
        layout = cls(
            num_layers=int(match["layers"]),
            top_k=int(match["top_k"]),
            num_experts=int(match["experts"]),
            block_size=int(match["block"]),
            dense_layers=tuple(int(i) for i in dense.split(",")) if dense else (),
        )
        if layout.canonical() != text:
            raise SchemaError(f"R3 layout {text!r} does not match its own fields")
        return layout

    def empty(self, num_tokens: int, arrays: RecycledArrays | None = None) -> np.ndarray:
        """Uninitialized array for ``num_tokens`` rows (from ``arrays``' reused memory if
        given)."""
        return empty((num_tokens, self.num_layers, self.top_k), self.dtype, arrays)

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

    def mark_dense(self, rows: np.ndarray) -> None:
        """Set every dense-layer entry of ``rows`` to :attr:`dense_mark` (in place).

        Rank zero does this on the engine's step thread for every step's rows. For C-ordered
        rows each run of consecutive dense layers is one opaque item per token, filled with
        one item: a per-token fill that keeps the GIL for a few hundred tokens, where numpy's
        strided and fancy assignments release it (docs/design.md, "The step path keeps the
        GIL") and take several times longer.
        """
        if not self.dense_layers or not len(rows):
            return
        if (
            not rows.flags.c_contiguous
            or rows.dtype != self.dtype
            or rows.shape[1:] != self.row_shape
        ):
            rows[:, self._dense_index, :] = self.dense_mark
            return
        row_bytes = rows.reshape(len(rows), -1).view(np.uint8)
        for start, stop, mark in self._dense_runs:
            row_bytes[:, start:stop].view(mark.dtype)[:, 0] = mark

    @cached_property
    def _dense_runs(self) -> list[tuple[int, int, np.void]]:
        """Byte ranges of a row holding consecutive dense layers, with the bytes they get."""
        runs: list[list[int]] = []
        for layer in self.dense_layers:
            if runs and runs[-1][1] == layer:
                runs[-1][1] = layer + 1
            else:
                runs.append([layer, layer + 1])
        layer_nbytes = self.top_k * self.dtype.itemsize
        out = []
        for first, end in runs:
            nbytes = (end - first) * layer_nbytes
            mark = np.full((end - first) * self.top_k, self.dense_mark, dtype=self.dtype)
            out.append(
                (
                    first * layer_nbytes,
                    end * layer_nbytes,
                    mark.view(np.dtype((np.void, nbytes)))[0],
                )
            )
        return out

    @cached_property
    def _dense_index(self) -> np.ndarray:
        return np.array(self.dense_layers, dtype=np.intp)

    def check_ids(self, rows: np.ndarray, *, what: str = "rows") -> None:
        """Check expert ids are < num_experts and dense layers hold the dense mark."""
        if rows.size == 0:
            return
        moe = rows[:, self.moe_layer_mask, :]
        if moe.size and int(moe.max()) >= self.num_experts:
            raise SchemaError(
                f"{what} hold expert id {int(moe.max())} >= num_experts={self.num_experts}"
            )
        if self.dense_layers and (rows[:, self._dense_index, :] != self.dense_mark).any():
            raise SchemaError(f"{what} have entries other than {self.dense_mark} in dense layers")
