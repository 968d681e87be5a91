"""``python -m vllm_artifact.selftest``, the check users run on their own install, passes here
(vLLM's CPU build): every case PASS, exit code 0, the versions named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_artifact_testing.engine_env import apply_cpu_engine_env

pytestmark = pytest.mark.engine


def test_the_selftest_passes_on_this_install(tmp_path: Path) -> None:
    out = tmp_path / "selftest.json"
    run = subprocess.run(
        [sys.executable, "-m", "vllm_artifact.selftest", "--json", str(out)],
        env=apply_cpu_engine_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "PASS: R3 equals the oracle in every case" in run.stdout
    report = json.loads(out.read_text())
    assert report["versions"]["vllm"] == "0.32.0"
    cases = {case["name"]: case for case in report["cases"]}
    assert len(cases) == 8 and all(case["status"] == "PASS" for case in cases.values()), cases
    assert all(case["rows"] > 0 and case["equal"] == case["rows"] for case in cases.values())
    assert "speculative decoding (n-gram)" in cases
