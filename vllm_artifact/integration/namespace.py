"""What R3 objects of one engine are keyed under: model identity and R3 layout.

KV block hashes identify token content only; our keys add the model (path, revision and a
digest of its config, so a rebuilt model at the same path gets new keys), the R3 layout
(layers, top-k, experts, dense layers, block size) and the weight version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

from vllm_artifact.core.schema import R3Layout


def model_identity(vllm_config: Any) -> str:
    model_config = vllm_config.model_config
    config_json = model_config.hf_config.to_json_string(use_diff=False)
    digest = hashlib.sha256(config_json.encode()).hexdigest()[:16]
    return f"{model_config.model}@{model_config.revision or 'local'}#config:{digest}"


def moe_layer_ids(model: torch.nn.Module) -> set[int]:
    """Decoder layers whose router vLLM's capturer is bound to (after binding)."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCaptureSource,
    )
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    layers: set[int] = set()
    for module in model.modules():
        if isinstance(module, (RoutedExpertsCaptureSource, MoERunner)):
            layers.add(int(module.layer_id))
    return layers


def r3_layout(
    *, num_layers: int, top_k: int, num_experts: int, block_size: int, moe_layers: Iterable[int]
) -> R3Layout:
    moe = set(moe_layers)
    dense = tuple(i for i in range(num_layers) if i not in moe)
    return R3Layout(
        num_layers=num_layers,
        top_k=top_k,
        num_experts=num_experts,
        block_size=block_size,
        dense_layers=dense,
    )
