"""Client side: decode routed-experts (R3) payloads. Imports neither vLLM nor torch."""

from vllm_artifact.client.decode import (
    RoutedExperts,
    decode_r3,
    decode_routed_experts,
    dense_layers,
)
from vllm_artifact.core.failure import R3Failure, r3_failure

__all__ = [
    "R3Failure",
    "RoutedExperts",
    "decode_r3",
    "decode_routed_experts",
    "dense_layers",
    "r3_failure",
]
