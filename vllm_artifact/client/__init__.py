"""Client side: decode routed-experts (R3) payloads. Imports neither vLLM nor torch."""

from vllm_artifact.client.decode import decode_routed_experts
from vllm_artifact.core.failure import R3Failure, r3_failure

__all__ = ["R3Failure", "decode_routed_experts", "r3_failure"]
