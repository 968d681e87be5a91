"""Fixtures for end-to-end tests: real vLLM engines and servers on the tiny MoE models.

Engines are expensive (~25-40 s to start on 2 CPU cores), so each is shared by a module.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from vllm_artifact_testing.chaos import sigkill_processes, vllm_shm_segments
from vllm_artifact_testing.engine_env import ENGINE_KWARGS, apply_cpu_engine_env

from vllm_artifact.selftest.tiny_models import ensure_tiny_model

apply_cpu_engine_env()
# Tests read connector counters from the workers with collective_rpc(<function>), which vLLM
# only pickles when this is set (loopback-only test engines).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

MODEL_A = "qwen3-moe-8x2"  # 8 experts, top-2, all layers MoE: uint8 rows
MODEL_B = "qwen3-moe-300x4-dense1"  # 300 experts, top-4, layer 1 dense: uint16 rows


@pytest.fixture(scope="session")
def model_a() -> Path:
    return ensure_tiny_model(MODEL_A)


@pytest.fixture(scope="session")
def model_b() -> Path:
    return ensure_tiny_model(MODEL_B)


def start_llm(model: Path, **overrides: Any) -> Any:
    """A real offline ``vllm.LLM`` with routed experts on, through our keyword."""
    from vllm import LLM

    kwargs: dict[str, Any] = {**ENGINE_KWARGS, **overrides}
    return LLM(str(model), enable_routed_experts=True, **kwargs)


def kill_llm(llm: Any) -> None:
    """Stop an engine (idempotent): SIGKILL its processes, then close the client. A test
    takes what it needs from an engine before it is killed (``connector_stats`` waits for its
    publications); vLLM 0.32's clean shutdown would take ~5 s per engine here (the worker
    spends ~4 s in the interpreter's final garbage collection and the engine core is
    force-killed after a 5 s grace), about a minute over the suite."""
    if getattr(llm, "_test_shut_down", False):
        return
    processes: list[psutil.Process] = []
    for engine in llm.llm_engine.engine_core.resources.engine_manager.processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            core = psutil.Process(engine.pid)
            processes += [core, *core.children(recursive=True)]
    segments = vllm_shm_segments(processes)
    sigkill_processes(processes)
    for segment in segments:  # vLLM unlinks them only on a clean shutdown
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment)
    llm._test_shut_down = True
    # The processes are gone: this closes the client's sockets. vLLM may ask an exited child
    # for its name, which is fine.
    with contextlib.suppress(psutil.NoSuchProcess):
        llm.llm_engine.engine_core.shutdown()
    gc.collect()


@pytest.fixture(scope="session")
def kill_engine() -> Any:
    return kill_llm


@pytest.fixture(scope="module")
def store_root() -> Iterator[Path]:
    """A private store root under /dev/shm for one module's engines, removed afterwards."""
    root = Path(f"/dev/shm/vllm-artifact-test-{uuid.uuid4().hex[:8]}")
    root.mkdir(mode=0o700)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def llm_factory() -> Iterator[Any]:
    """Starts engines for one module and shuts them all down at its end."""
    started: list[Any] = []

    def make(model: Path, **overrides: Any) -> Any:
        llm = start_llm(model, **overrides)
        started.append(llm)
        return llm

    yield make
    for llm in started:
        kill_llm(llm)
