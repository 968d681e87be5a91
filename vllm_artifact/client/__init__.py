"""Client side: decode routed-experts (R3) payloads. Imports neither vLLM nor torch."""

from vllm_artifact.client.decode import decode_routed_experts

__all__ = ["decode_routed_experts"]
