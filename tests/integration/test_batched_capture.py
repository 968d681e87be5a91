"""Eager steps captured by reference and joined once give what vLLM's per-layer capture gives;
a step whose captures do not add up is refused, never answered from stale rows."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

from vllm_artifact.core.schema import R3Layout
from vllm_artifact.errors import InternalError
from vllm_artifact.integration import capture
from vllm_artifact.integration.capture import BatchedEagerCapturer, batching_applies
from vllm_artifact.integration.worker_connector import ArtifactWorkerConnector

MAX_TOKENS, LAYERS, TOP_K = 16, 4, 3
DENSE = 0  # layer 0 has no router, as DeepSeek-V3's first layers


def make(cls: type[RoutedExpertsCapturer]) -> RoutedExpertsCapturer:
    """A capturer with vLLM's buffer and output dtype, without a model config."""
    capturer = object.__new__(cls)
    capturer.device_buffer = torch.zeros((MAX_TOKENS, LAYERS, TOP_K), dtype=torch.int32)
    capturer.output_dtype = torch.uint8
    capturer.dp_rank, capturer.tp_size = 0, 1
    return capturer


@pytest.fixture(autouse=True)
def no_data_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward context of a step without data parallelism (set by vLLM in a forward)."""
    context = SimpleNamespace(dp_metadata=None)
    monkeypatch.setattr(capture, "get_forward_context", lambda: context)
    monkeypatch.setattr(
        "vllm.model_executor.layers.fused_moe.routed_experts_capturer.get_forward_context",
        lambda: context,
    )


def routed(num_tokens: int, seed: int, dtype: torch.dtype = torch.int64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (num_tokens, TOP_K), generator=generator, dtype=dtype)
        for _ in range(LAYERS)
    ]


def run_step(
    capturer: RoutedExpertsCapturer, ids: list[torch.Tensor], num_tokens: int
) -> np.ndarray:
    for layer in range(LAYERS):
        if layer != DENSE:
            capturer.capture(layer, ids[layer])
    return capturer.snapshot_routing_data(num_tokens).numpy()


def batched() -> BatchedEagerCapturer:
    capturer = make(BatchedEagerCapturer)
    assert isinstance(capturer, BatchedEagerCapturer)
    capturer.batch_eager_steps(LAYERS - 1)
    return capturer


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_a_batched_eager_step_equals_vllms_per_layer_capture(dtype: torch.dtype) -> None:
    vllms, ours = make(RoutedExpertsCapturer), batched()
    for step, (computed, padded) in enumerate([(9, 12), (16, 16), (1, 4)]):
        ids = routed(padded, seed=step, dtype=dtype)  # a forward may run padded rows
        ours.step_started()
        expected, got = run_step(vllms, ids, computed), run_step(ours, ids, computed)
        assert got.dtype == expected.dtype == np.uint8
        assert got.shape == (computed, LAYERS, TOP_K)
        np.testing.assert_array_equal(got, expected)
        assert not got[:, DENSE].any()
    assert not ours.device_buffer.any()  # vLLM's copies never ran


def test_a_step_whose_captures_do_not_add_up_is_refused() -> None:
    ours = batched()
    ids = routed(5, seed=1)
    ours.capture(1, ids[1])
    with pytest.raises(InternalError, match="1 routed-experts captures of 1 layers in a step of 3"):
        ours.snapshot_routing_data(5)
    for layer in (1, 2, 2):  # as many captures as layers, but layer 3 never captured
        ours.capture(layer, ids[layer])
    with pytest.raises(InternalError, match="3 routed-experts captures of 2 layers"):
        ours.snapshot_routing_data(5)
    for layer in (1, 2):
        ours.capture(layer, ids[layer])
    ours.capture(3, ids[3][:, :2])  # top-k ids that cannot be stacked with the rest
    with pytest.raises(InternalError, match="do not join"):
        ours.snapshot_routing_data(5)
    run_step(ours, ids, 5)  # the next step starts clean
    for layer in (1, 2, 3, 3):
        ours.capture(layer, ids[layer])
    with pytest.raises(InternalError, match="4 routed-experts captures"):
        ours.snapshot_routing_data(5)


def test_warm_up_captures_are_dropped_when_a_step_starts() -> None:
    ours = batched()
    stale = routed(5, seed=2)
    for layer in (1, 2):  # a dummy run cut short, or one with fewer layers
        ours.capture(layer, stale[layer])
    ours.step_started()
    fresh = routed(5, seed=3)
    np.testing.assert_array_equal(
        run_step(ours, fresh, 5), run_step(make(RoutedExpertsCapturer), fresh, 5)
    )


def test_after_a_graph_replay_the_snapshot_is_vllms_buffer() -> None:
    """A replayed CUDA graph wrote the buffer and called no capture: vLLM's snapshot."""
    ours = batched()
    ours.device_buffer[:6] = torch.arange(6 * LAYERS * TOP_K, dtype=torch.int32).reshape(
        6, LAYERS, TOP_K
    )
    ours.step_started()
    np.testing.assert_array_equal(
        ours.snapshot_routing_data(6).numpy(), ours.device_buffer[:6].to(torch.uint8).numpy()
    )


def test_without_batching_every_capture_is_vllms() -> None:
    ours = make(BatchedEagerCapturer)  # batch_eager_steps not called (data parallelism etc.)
    ids = routed(7, seed=4)
    got = run_step(ours, ids, 7)
    assert ours.device_buffer.any()
    np.testing.assert_array_equal(got, run_step(make(RoutedExpertsCapturer), ids, 7))


def test_batching_applies_only_without_data_or_expert_parallelism_or_eplb() -> None:
    def config(**parallel: object) -> SimpleNamespace:
        fields = {"data_parallel_size": 1, "enable_expert_parallel": False, "enable_eplb": False}
        return SimpleNamespace(parallel_config=SimpleNamespace(**(fields | parallel)))

    assert batching_applies(config())
    assert not batching_applies(config(data_parallel_size=2))
    assert not batching_applies(config(enable_expert_parallel=True))
    assert not batching_applies(config(enable_eplb=True))


def test_a_refused_snapshot_fails_the_steps_requests_and_the_engine_goes_on() -> None:
    connector = object.__new__(ArtifactWorkerConnector)
    connector._process, connector._steps_started = None, 0
    connector._facts_due = []
    connector._lock = threading.Lock()
    connector._capturer = batched()
    connector._tracker = SimpleNamespace(step_started=lambda ids: None)  # type: ignore[assignment]
    connector._step_active = True
    connector._layout = R3Layout(num_layers=LAYERS, top_k=TOP_K, num_experts=256, block_size=4)
    connector._capturer.capture(2, routed(3, seed=5)[2])  # one layer of three
    batch = SimpleNamespace(
        req_ids=["a", "b"],
        query_start_loc_np=np.array([0, 1, 3]),
        num_computed_tokens_np=np.array([0, 0]),
    )
    pending = connector.prepare_output(batch)  # type: ignore[arg-type]
    assert pending is not None and pending.snapshot is None
    pending.enqueue_cpu_copy(np.array([1, 1], np.int32), np.array([0, 0], np.int32))
    result = pending.process_output()
    assert sorted(result.entries) == ["a", "b"]
    for failure in result.entries.values():
        assert "routed-experts captures" in str(failure.message)
