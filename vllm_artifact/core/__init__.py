"""Pure core of vllm-artifact: schema, keys, envelope, buffer, tracker, stores.

Imports neither vLLM nor torch (numpy, xxhash and pybase64 only), so clients, tests and
tools can use it anywhere; ``tests/core/test_no_heavy_imports.py`` enforces it.
"""

from vllm_artifact.core.buffer import FullBlocks, RequestRowBuffer, TailRows
from vllm_artifact.core.envelope import SCHEMA_VERSION
from vllm_artifact.core.keys import (
    Namespace,
    ObjectKey,
    full_block_key,
    full_block_keys,
    tail_block_key,
)
from vllm_artifact.core.schema import R3Layout, dtype_for_experts

__all__ = [
    "SCHEMA_VERSION",
    "FullBlocks",
    "Namespace",
    "ObjectKey",
    "R3Layout",
    "RequestRowBuffer",
    "TailRows",
    "dtype_for_experts",
    "full_block_key",
    "full_block_keys",
    "tail_block_key",
]
