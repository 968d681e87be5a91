"""Which store an engine writes (integration/engine_store.py), with real writer processes:
a restarted second engine takes a dead sibling's store over instead of making a new one."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_artifact.integration.engine_store import store_names

OPEN_AND_HOLD = """
import sys, time
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.integration.engine_store import open_engine_store
layout = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=())
store = open_engine_store(sys.argv[1], "r3-model-dp0", layout=layout, capacity_bytes=1 << 20,
                          ttl_seconds=3600)
print(store.name, flush=True)
time.sleep(600)
"""


@pytest.fixture
def root() -> Iterator[str]:
    path = Path(f"/dev/shm/vat-names-{os.getpid()}-{secrets.token_hex(3)}")
    path.mkdir(mode=0o700)
    yield str(path)
    shutil.rmtree(path, ignore_errors=True)


def start_engine(root: str) -> tuple[subprocess.Popen[str], str]:
    """A process that opens its engine store and holds it (as a live engine's writer does)."""
    process = subprocess.Popen(
        [sys.executable, "-c", OPEN_AND_HOLD, root], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    return process, process.stdout.readline().strip()


def test_restarted_engines_reuse_dead_siblings_stores(root: str) -> None:
    started: list[subprocess.Popen[str]] = []
    try:
        first, first_name = start_engine(root)
        second, second_name = start_engine(root)
        started += [first, second]
        assert [first_name, second_name] == store_names("r3-model-dp0")[:2]
        second.send_signal(signal.SIGKILL)  # the second engine crashes ...
        second.wait()
        third, third_name = start_engine(root)  # ... and is started again
        started.append(third)
        assert third_name == second_name
        assert sorted(os.listdir(root)) == sorted([first_name, second_name])
    finally:
        for process in started:
            process.kill()
            process.wait()
