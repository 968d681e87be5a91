"""R3 layout: dtype rule, shape checks, the dense-layer mask and mark."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vllm_artifact.core import R3Layout, dtype_for_experts
from vllm_artifact.errors import SchemaError

from .conftest import gil_releases


@pytest.mark.parametrize(
    ("experts", "top_k", "dtype"),
    [
        (1, 1, np.uint8),
        (8, 2, np.uint8),
        (255, 1, np.uint8),
        (256, 8, np.uint8),  # DeepSeek-V3: 255 is an id, but 8 equal ids are no routed row
        (256, 1, np.uint16),  # top-1: 255 would be ambiguous, so the mark needs uint16
        (257, 2, np.uint16),
        (300, 4, np.uint16),
        (65536, 2, np.uint16),
    ],
)
def test_dtype_rule(experts: int, top_k: int, dtype: type) -> None:
    assert dtype_for_experts(experts, top_k) == np.dtype(dtype)


@pytest.mark.parametrize(("experts", "top_k"), [(0, 1), (65537, 2), (-3, 1), (65536, 1)])
def test_dtype_rule_rejects_out_of_range(experts: int, top_k: int) -> None:
    with pytest.raises(SchemaError):
        dtype_for_experts(experts, top_k)


def test_deepseek_v3_sizes() -> None:
    lay = R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16)
    assert lay.dtype == np.uint8
    assert lay.row_nbytes == 464
    assert lay.block_nbytes == 16 * 464
    wide = R3Layout(num_layers=4, top_k=4, num_experts=300, block_size=32, dense_layers=(1,))
    assert wide.dtype == np.uint16 and wide.row_nbytes == 32


def test_dense_layer_mask_and_mark_tell_dense_from_expert_zero() -> None:
    lay = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=(0, 3))
    assert lay.moe_layer_mask.tolist() == [False, True, True, False]
    assert not lay.moe_layer_mask.flags.writeable
    assert lay.dense_mark == 255
    rows = np.zeros((2, 4, 2), dtype=np.uint8)  # what vLLM's capturer leaves: zeros
    with pytest.raises(SchemaError, match="dense"):
        lay.check_ids(rows)
    lay.mark_dense(rows)
    assert (rows[:, [0, 3]] == 255).all() and not rows[:, [1, 2]].any()
    lay.check_ids(rows)  # expert 0 in the MoE layers: valid
    rows[0, 3, 1] = 5
    with pytest.raises(SchemaError, match="dense"):
        lay.check_ids(rows)
    rows[0, 3, 1] = 255
    rows[1, 1, 0] = 8
    with pytest.raises(SchemaError, match="expert id 8"):
        lay.check_ids(rows)


@given(
    num_layers=st.integers(1, 12),
    top_k=st.integers(1, 4),
    wide=st.booleans(),
    dense_bits=st.integers(0, 2**12 - 1),
    tokens=st.integers(0, 40),
    c_ordered=st.booleans(),
)
def test_mark_dense_sets_exactly_the_dense_entries(
    num_layers: int, top_k: int, wide: bool, dense_bits: int, tokens: int, c_ordered: bool
) -> None:
    """Runs of consecutive dense layers are filled as one item per token: the same result as
    numpy's assignment of the mark to every dense entry, for any dense-layer pattern."""
    dense = tuple(i for i in range(num_layers) if dense_bits >> i & 1)
    assume(len(dense) < num_layers)  # a layout has a MoE layer
    lay = R3Layout(
        num_layers=num_layers,
        top_k=top_k,
        num_experts=300 if wide else 8,
        block_size=16,
        dense_layers=dense,
    )
    rng = np.random.default_rng(dense_bits)
    rows = rng.integers(0, 8, (tokens, num_layers, top_k)).astype(lay.dtype)
    expected = rows.copy()
    expected[:, list(dense), :] = lay.dense_mark
    if not c_ordered:  # every other token of a larger array: the general path
        spaced = np.zeros((2 * tokens, num_layers, top_k), dtype=lay.dtype)
        spaced[::2] = rows
        rows = spaced[::2]
    lay.mark_dense(rows)
    np.testing.assert_array_equal(rows, expected)


def test_marking_a_decode_steps_dense_layers_keeps_the_gil() -> None:
    """Rank zero marks every step's rows on the engine's step thread (docs/design.md, "The
    step path keeps the GIL"): DeepSeek-V3 as vLLM captures it (61 layers, 0-2 dense), 256
    requests, repeated so that one release per step would be seen all but surely."""
    lay = R3Layout(num_layers=61, top_k=8, num_experts=256, block_size=16, dense_layers=(0, 1, 2))
    rows = np.zeros((256, 61, 8), dtype=np.uint8)
    with gil_releases() as count:
        before = count[0]
        for _ in range(300):
            lay.mark_dense(rows)
        releases = count[0] - before
    assert (rows[:, :3] == 255).all() and not rows[:, 3:].any()
    assert releases == 0


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


@pytest.mark.parametrize(
    "layout",
    [
        R3Layout(num_layers=58, top_k=8, num_experts=256, block_size=16),
        R3Layout(num_layers=4, top_k=4, num_experts=300, block_size=32, dense_layers=(1,)),
        R3Layout(num_layers=6, top_k=2, num_experts=8, block_size=16, dense_layers=(0, 2, 5)),
    ],
)
def test_layout_reads_back_from_its_canonical_text(layout: R3Layout) -> None:
    assert R3Layout.from_canonical(layout.canonical()) == layout


@pytest.mark.parametrize(
    "text",
    [
        "r3-layout/v1;layers=4",
        # a dtype the fields do not give (300 experts need uint16)
        "r3-layout/v2;layers=4;top_k=4;experts=300;block=32;dense=[1];dtype=uint8;dense_mark=255",
        "r3-layout/v2;layers=4;top_k=4;experts=8;block=32;dense=[7];dtype=uint8;dense_mark=255",
    ],
)
def test_a_text_that_is_not_a_layout_is_refused(text: str) -> None:
    with pytest.raises(SchemaError):
        R3Layout.from_canonical(text)
