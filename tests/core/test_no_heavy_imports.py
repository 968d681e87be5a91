"""The core and the client import neither vLLM nor torch (trainers and tools use them alone),
nor does the tracker process (it starts beside a running engine, and must start quickly)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import vllm_artifact.core, vllm_artifact.core.store, vllm_artifact.errors
import vllm_artifact.core.store.shm, vllm_artifact.core.buffer, vllm_artifact.contract
import vllm_artifact.core.tracker, vllm_artifact.core.json_splice, vllm_artifact.client
import vllm_artifact.integration.tracker_service, vllm_artifact.core.step_facts
heavy = sorted(m for m in sys.modules if m.split('.')[0] in {'vllm', 'torch', 'triton'})
print(','.join(heavy))
"""


def test_core_imports_no_vllm_or_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == ""
