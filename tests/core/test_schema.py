"""R3 layout: dtype rule, shape checks and the dense-layer mask."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_artifact.core import R3Layout, dtype_for_experts
from vllm_artifact.errors import SchemaError


@pytest.mark.parametrize(
    ("experts", "dtype"),
    [
        (1, np.uint8),
        (8, np.uint8),
        (256, np.uint8),
        (257, np.uint16),
        (300, np.uint16),
        (65536, np.uint16),
    ],
)
def test_dtype_rule(experts: int, dtype: type) -> None:
    assert dtype_for_experts(experts) == np.dtype(dtype)


@pytest.mark.parametrize("experts", [0, 65537, -3])
def test_dtype_rule_rejects_out_of_range(experts: int) -> None:
    with pytest.raises(SchemaError):
        dtype_for_experts(experts)


def test_deepseek_v3_sizes() -> None:
    lay = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
    assert lay.dtype == np.uint8
    assert lay.row_nbytes == 464
    assert lay.block_nbytes == 16 * 464
    wide = R3Layout(num_layers=4, top_k=4, num_experts=300, block_size=32, dense_layers=(1,))
    assert wide.dtype == np.uint16 and wide.row_nbytes == 32


def test_dense_layer_mask_tells_dense_from_expert_zero() -> None:
    lay = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=(0, 3))
    assert lay.moe_layer_mask.tolist() == [False, True, True, False]
    assert not lay.moe_layer_mask.flags.writeable
    rows = np.zeros((2, 4, 2), dtype=np.uint8)  # expert 0 everywhere: valid
    lay.check_ids(rows)
    rows[0, 3, 1] = 5
    with pytest.raises(SchemaError, match="dense"):
        lay.check_ids(rows)
    rows[0, 3, 1] = 0
    rows[1, 1, 0] = 8
    with pytest.raises(SchemaError, match="expert id 8"):
        lay.check_ids(rows)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "top_k": 1, "num_experts": 8, "block_size": 16},
        {"num_layers": 2, "top_k": 9, "num_experts": 8, "block_size": 16},
        {"num_layers": 2, "top_k": 1, "num_experts": 8, "block_size": 0},
        {"num_layers": 2, "top_k": 1, "num_experts": 8, "block_size": 16, "dense_layers": (2,)},
        {"num_layers": 2, "top_k": 1, "num_experts": 8, "block_size": 16, "dense_layers": (1, 0)},
        {"num_layers": 2, "top_k": 1, "num_experts": 8, "block_size": 16, "dense_layers": (0, 1)},
        {"num_layers": 5000, "top_k": 1, "num_experts": 8, "block_size": 16},
        {"num_layers": True, "top_k": 1, "num_experts": 8, "block_size": 16},
    ],
)
def test_layout_validation(kwargs: dict[str, object]) -> None:
    with pytest.raises(SchemaError):
        R3Layout(**kwargs)  # type: ignore[arg-type]


def test_check_rows(layout: R3Layout) -> None:
    good = layout.empty(3)
    assert layout.check_rows(good) is good
    non_contig = np.zeros((3, layout.num_layers, layout.top_k * 2), dtype=layout.dtype)[:, :, ::2]
    fixed = layout.check_rows(non_contig)
    assert fixed.flags.c_contiguous and fixed.shape == (3, *layout.row_shape)
    with pytest.raises(SchemaError, match="dtype"):
        layout.check_rows(good.astype(np.uint16))
    with pytest.raises(SchemaError, match="shape"):
        layout.check_rows(np.zeros((3, layout.num_layers), dtype=layout.dtype))
    with pytest.raises(SchemaError, match="numpy"):
        layout.check_rows([[1]])


def test_canonical_distinguishes_layouts() -> None:
    base = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16)
    variants = [
        R3Layout(num_layers=5, top_k=2, num_experts=8, block_size=16),
        R3Layout(num_layers=4, top_k=3, num_experts=8, block_size=16),
        R3Layout(num_layers=4, top_k=2, num_experts=9, block_size=16),
        R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=32),
        R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=(1,)),
    ]
    assert len({base.canonical(), *(v.canonical() for v in variants)}) == 6
