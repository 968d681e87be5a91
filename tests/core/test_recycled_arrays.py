"""RecycledArrays: memory is reused only once nothing refers to it, within its bound."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_publication import _one_array

SHAPE = (2049, 58, 8)  # a prompt's rows, DeepSeek-V3-sized: 951 KB


def _filled(arrays: RecycledArrays, value: int) -> np.ndarray:
    out = arrays.empty(SHAPE, np.uint8)
    out[:] = value
    return out


def test_memory_is_reused_only_after_every_view_is_gone() -> None:
    arrays = RecycledArrays()
    first = _filled(arrays, 1)
    # Each kind of reference that must keep the memory from reuse.
    keepers = [
        lambda a: a[100:200],
        lambda a: a.reshape(-1)[::3],
        lambda a: a[5:9].view(np.int8)[1:],
        lambda a: memoryview(a[1:2]),
        lambda a: torch.from_numpy(a[7:9]),
    ]
    for keep in keepers:
        kept = keep(first)
        del first
        # Arrays handed out while the view lives never share its memory, and writing them
        # leaves the kept rows as they were.
        others = [_filled(arrays, 7) for _ in range(3)]
        assert np.all(np.asarray(kept) == 1)
        assert not any(np.shares_memory(np.asarray(kept), other) for other in others)
        del others, kept
        first = _filled(arrays, 1)  # as before the round, without a view
    kept_buffers = arrays.nbytes
    del first
    again = arrays.empty(SHAPE, np.uint8)
    assert again.base is not None and arrays.nbytes == kept_buffers  # no new buffer


def test_memory_dropped_on_another_thread_is_reused() -> None:
    arrays = RecycledArrays()
    box = [_filled(arrays, 3)]
    address = box[0].__array_interface__["data"][0]
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    again = arrays.empty(SHAPE, np.uint8)
    assert arrays.reused == 1
    assert again.__array_interface__["data"][0] == address


def test_the_pool_keeps_at_most_max_bytes_and_small_arrays_are_plain() -> None:
    arrays = RecycledArrays(max_bytes=3 * 1024 * 1024)  # three 1 MiB buffers
    held = [arrays.empty(SHAPE, np.uint8) for _ in range(5)]
    assert arrays.nbytes == 3 * 1024 * 1024
    assert sum(a.base is not None and a.base.nbytes == 1 << 20 for a in held) == 3
    assert all(a.base is None for a in held[3:])  # plain arrays past the bound
    small = arrays.empty((10, 58, 8), np.uint8)
    assert small.base is None and arrays.nbytes == 3 * 1024 * 1024
    # A larger class gets room from free buffers of the smaller one, never from used ones.
    del held[0], held[0]
    big = arrays.empty((4000, 58, 8), np.uint8)  # 1.8 MB: the 2 MiB class
    assert big.base is not None and big.base.nbytes == 2 << 20
    assert arrays.nbytes == 3 * 1024 * 1024  # two 1 MiB buffers dropped for it
    assert held[0].base is not None  # the one still used stays


def test_arrays_of_other_types_and_a_layout() -> None:
    arrays = RecycledArrays()
    layout = R3Layout(num_layers=58, top_k=8, num_experts=300, block_size=16)  # int16 rows
    rows = layout.empty(1000, arrays)
    assert rows.shape == (1000, 58, 8) and rows.dtype == layout.dtype
    assert rows.base is not None and rows.flags.c_contiguous


def test_blocks_cut_from_a_recycled_array_are_published_as_one_view() -> None:
    arrays = RecycledArrays()
    out = arrays.empty((128, 58, 8), np.int16)  # 119 KB: recycled
    out[:] = np.arange(128, dtype=np.int16)[:, None, None]
    blocks = [out[i : i + 16] for i in range(0, 128, 16)]
    joined = _one_array(blocks[1:])
    assert out.base is not None and joined.shape == (112, 58, 8) and joined.dtype == np.int16
    assert np.shares_memory(joined, out)
    np.testing.assert_array_equal(joined, out[16:])


def test_finer_size_classes_waste_at_most_their_step() -> None:
    """Powers of two by default; four steps a doubling leave at most a quarter unused."""
    coarse, fine = RecycledArrays(), RecycledArrays(steps_per_doubling=4)
    for nbytes in (1, 2, 3, 5, 64 * 1024, 64 * 1024 + 1, 951_104, 1 << 20, (1 << 20) + 1):
        power = 1 << (nbytes - 1).bit_length()
        assert coarse.size_class(nbytes) == power
        size = fine.size_class(nbytes)
        assert nbytes <= size <= power and (size - nbytes) * 4 < max(nbytes, 4)
    assert fine.size_class(700_000) == 786_432  # 2**17 * 6: 12% unused, not 50%
    held = fine.empty(SHAPE, np.uint8)
    assert held.base is not None and held.base.nbytes == fine.size_class(held.nbytes)
    with pytest.raises(ValueError, match="steps_per_doubling"):
        RecycledArrays(steps_per_doubling=3)
