"""vLLM's routed-experts capturer, with eager steps captured by reference and joined once.

vLLM's ``RoutedExpertsCapturer.capture`` copies each MoE layer's top-k ids into its device
buffer as the layer runs: one strided, dtype-converting copy per layer. Inside a CUDA graph
that costs nothing at replay. In an eager step (prefill chunks, batches above the largest
graph) it is one copy launch per MoE layer, with its Python, on the engine's main thread,
which in eager steps is what the step waits for: 58 per DeepSeek-V3 step.

:class:`BatchedEagerCapturer` keeps a reference to each layer's top-k ids instead and joins
them in :meth:`~BatchedEagerCapturer.snapshot_routing_data` with one stack. Graph capture,
data-parallel layouts (whose slicing and gathering stay vLLM's), expert parallelism and
EPLB take vLLM's path unchanged. A step whose captures do not add up (some layers captured
eagerly, not all, or one twice) is refused with an error, which fails that step's requests
closed; never a snapshot of stale rows.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCapturer

from vllm_artifact.errors import InternalError

__all__ = ["BatchedEagerCapturer", "batching_applies"]


def batching_applies(vllm_config: Any) -> bool:
    """Whether the router's top-k ids reach the capturer as this rank's rows, never written
    again in the forward: no data parallelism (vLLM slices or gathers those), no expert
    parallelism and no EPLB (whose mapping follows the capture)."""
    parallel = vllm_config.parallel_config
    return not (
        parallel.data_parallel_size > 1
        or getattr(parallel, "enable_expert_parallel", False)
        or getattr(parallel, "enable_eplb", False)
    )


class BatchedEagerCapturer(RoutedExpertsCapturer):
    """vLLM's capturer; with :meth:`batch_eager_steps`, eager steps are captured by
    reference (module docstring). :meth:`step_started` opens each step."""

    _moe_layers: int = 0  # MoE layers bound; 0: every capture takes vLLM's path
    _captured: int = 0  # eager captures since the step started
    _layers: list[torch.Tensor | None] = []  # each layer's top-k ids (eager)
    _zeros: torch.Tensor | None = None  # stands in for dense layers (marked later)

    def batch_eager_steps(self, moe_layers: int) -> None:
        """Capture eager steps by reference; ``moe_layers`` routers are bound to us."""
        self._moe_layers = moe_layers
        self._layers = [None] * self.device_buffer.shape[1]

    def step_started(self) -> None:
        """A step begins: what earlier forwards (warm-up, dummy runs) captured is dropped."""
        if self._captured:
            self._captured = 0
            self._layers = [None] * len(self._layers)

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if (
            not self._moe_layers
            or (topk_ids.is_cuda and torch.cuda.is_current_stream_capturing())
            or get_forward_context().dp_metadata is not None
        ):
            super().capture(layer_id, topk_ids)
            return
        if not 0 <= layer_id < len(self._layers):
            raise IndexError(f"routed-experts layer {layer_id} exceeds {len(self._layers)} layers")
        self._layers[layer_id] = topk_ids
        self._captured += 1

    def snapshot_routing_data(self, num_tokens: int) -> torch.Tensor:
        """The step's rows, ``[num_tokens, layers, top_k]`` in vLLM's output dtype: from the
        device buffer after a graph replay, else joined from the eager captures."""
        captured, layers = self._captured, self._layers
        if not captured:
            return super().snapshot_routing_data(num_tokens)
        self._captured = 0
        self._layers = [None] * len(layers)
        distinct = sum(ids is not None for ids in layers)
        if captured != self._moe_layers or distinct != self._moe_layers:
            raise InternalError(
                f"{captured} routed-experts captures of {distinct} layers in a step of "
                f"{self._moe_layers} MoE layers"
            )
        parts = []
        for ids in layers:
            if ids is None:
                ids = self._dense_rows(layers, num_tokens)
            elif len(ids) < num_tokens:
                raise InternalError(f"a layer captured {len(ids)} of {num_tokens} tokens")
            parts.append(ids[:num_tokens])
        try:
            return torch.stack(parts, dim=1).to(self.output_dtype)
        except RuntimeError as error:  # e.g. layers whose top-k ids differ in shape
            raise InternalError(
                f"the step's routed-experts captures do not join: {error}"
            ) from None

    def _dense_rows(self, layers: list[torch.Tensor | None], num_tokens: int) -> torch.Tensor:
        """Zero rows for a layer without a router (process_output marks dense layers)."""
        like = next(ids for ids in layers if ids is not None)
        zeros = self._zeros
        if zeros is None or zeros.dtype != like.dtype or len(zeros) < num_tokens:
            shape = (max(num_tokens, len(self.device_buffer)), like.shape[1])
            zeros = self._zeros = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return zeros[:num_tokens]
