"""Client side: decode routed-experts (R3) payloads and read keys-only handles from the
engine's ``/dev/shm`` store. Imports neither vLLM nor torch."""

from vllm_artifact.client.decode import decode_r3, decode_routed_experts
from vllm_artifact.client.experts import RoutedExperts, dense_layers
from vllm_artifact.client.reader import R3Reader, read_r3_keys
from vllm_artifact.core.failure import R3Failure, r3_failure
from vllm_artifact.core.handoff import R3Keys

__all__ = [
    "R3Failure",
    "R3Keys",
    "R3Reader",
    "RoutedExperts",
    "decode_r3",
    "decode_routed_experts",
    "dense_layers",
    "r3_failure",
    "read_r3_keys",
]
