"""A keys-only handle leaves the frontend only if it resolves to exactly its request's rows
(the keys_answer hook); otherwise its request fails closed with the reason."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_artifact.client import reader as client_reader
from vllm_artifact.core import Namespace, R3Layout, full_block_keys
from vllm_artifact.core.failure import r3_failure
from vllm_artifact.core.handoff import R3Keys, RowsDigest, StoreAddress
from vllm_artifact.core.objects_digest import objects_digest
from vllm_artifact.core.store import ShmStore
from vllm_artifact.integration.hooks import after_import, keys_answer, request_errors

LAYOUT = R3Layout(num_layers=4, top_k=2, num_experts=8, block_size=16, dense_layers=())
NS = Namespace("m", LAYOUT, "v1")


@pytest.fixture
def store() -> Iterator[ShmStore]:
    root = Path(f"/dev/shm/vat-answer-{os.getpid()}-{secrets.token_hex(3)}")
    root.mkdir(mode=0o700)
    with ShmStore.create_or_open_writer(root, "r3-a", layout=LAYOUT, capacity_bytes=1 << 20) as s:
        yield s
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def quick_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """Handles that never resolve fail after 0.2 s here (the product waits 10 s)."""
    monkeypatch.setattr(client_reader, "_DEFAULT", client_reader.R3Reader(timeout=0.2))
    monkeypatch.setattr(request_errors, "FAILURES", request_errors._FailureMessages())


def finished_output(request_id: str, handles: list[R3Keys]) -> Any:
    completions = [
        SimpleNamespace(finish_reason="length", stop_reason=None, routed_experts=handle)
        for handle in handles
    ]
    return SimpleNamespace(request_id=request_id, finished=True, outputs=completions)


def handle(store: ShmStore, keys: list, rows: np.ndarray, *, digest: str = "rows") -> R3Keys:
    """A handle of ``rows`` under ``keys`` with the rows' digest (as the engine makes it for
    rows that do not start at a block boundary) or the objects' (the usual)."""
    digests = (
        {"rows_xxh3": RowsDigest.of(rows)}
        if digest == "rows"
        else {"objects_xxh3": objects_digest(LAYOUT, keys, 0, rows)}
    )
    return R3Keys.of(
        store=StoreAddress(root=store.root, name=store.name),
        layout=LAYOUT.canonical(),
        block_size=16,
        token_start=0,
        first_row=0,
        num_rows=len(rows),
        keys=keys,
        last_block_tokens=16,
        **digests,
    )


def test_handles_that_resolve_are_answered_unchanged(store: ShmStore) -> None:
    rows = np.arange(32 * 8, dtype=np.uint8).reshape(32, 4, 2) % 8
    keys = full_block_keys(NS, [b"a", b"b"])
    store.put_blocks(keys, rows, 0)
    good = handle(store, keys, rows)
    output = finished_output("cmpl-ok-0", [good])
    keys_answer.check_outputs([output])
    assert output.outputs[0].finish_reason == "length" and output.outputs[0].routed_experts is good


def test_unpublished_or_other_routing_fails_the_request_closed(store: ShmStore) -> None:
    """A tail that was never published (its publication failed) and a block another request
    published first with other routing: each request fails with its reason; the message
    reaches its HTTP answer."""
    rows = np.arange(32 * 8, dtype=np.uint8).reshape(32, 4, 2) % 8
    keys = full_block_keys(NS, [b"c", b"d"])
    store.put_blocks(keys[:1], rows[:16], 0)  # the second object never arrives
    missing = finished_output("cmpl-missing-0", [handle(store, keys, rows)])
    theirs = rows.copy()
    theirs[3, 1, 0] = (theirs[3, 1, 0] + 1) % 8
    keys2 = full_block_keys(NS, [b"e"])
    store.put_blocks(keys2, theirs[:16], 0)
    other = finished_output("cmpl-other-0", [handle(store, keys2, rows[:16])])
    keys_answer.check_outputs([missing, other])
    for output, reason in ((missing, "missing"), (other, "collision")):
        completion = output.outputs[0]
        assert completion.finish_reason == "error" and completion.routed_experts is None
        failure = r3_failure(completion.stop_reason)
        assert failure is not None and failure.reason == reason, completion.stop_reason
        base = output.request_id.rsplit("-", 1)[0]
        assert request_errors.FAILURES.take(base, request_errors._COMPLETIONS) == failure.message


def test_the_servers_generate_checks_finished_outputs_off_the_event_loop(store: ShmStore) -> None:
    """The AsyncLLM.generate wrap: a finished output is checked before it is yielded, the
    others pass through, and closing the stream closes vLLM's generator (its abort path)."""
    rows = np.arange(16 * 8, dtype=np.uint8).reshape(16, 4, 2) % 8
    keys = full_block_keys(NS, [b"never"])
    closed: list[bool] = []

    async def original(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            yield SimpleNamespace(request_id="cmpl-s-0", finished=False, outputs=[])
            yield finished_output("cmpl-s-0", [handle(store, keys, rows)])
        finally:
            closed.append(True)

    async def consume() -> list[Any]:
        return [output async for output in keys_answer._wrap_generate(original)(None)]

    outputs = asyncio.run(consume())
    assert [o.finished for o in outputs] == [False, True]
    assert outputs[1].outputs[0].finish_reason == "error" and closed == [True]


def test_every_callback_waiting_for_a_module_runs(tmp_path: Path) -> None:
    """Two hooks waiting for one module (weight_version and keys_answer both patch AsyncLLM):
    the import system asks only the first finder that answers, so one watcher calls both."""
    name = f"vat_after_import_{secrets.token_hex(3)}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    sys.path.insert(0, str(tmp_path))
    called: list[str] = []
    try:
        after_import.when_imported(name, lambda module: called.append("first"))
        after_import.when_imported(name, lambda module: called.append("second"))
        __import__(name)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)
    assert called == ["first", "second"]


ENGINE_MODULE_FIRST = """
import vllm.v1.engine.async_llm as async_llm  # first vLLM import: mid-import when hooks install
from vllm.engine.arg_utils import EngineArgs
from vllm_artifact.integration.hooks import WRAPPED_MARK
from vllm_artifact.integration.hooks.after_import import pending
def hooked():
    return [getattr(getattr(async_llm.AsyncLLM, name), WRAPPED_MARK, False)
            for name in ("generate", "update_weight_version", "finish_weight_update")]
print("before", hooked(), sorted(set(pending())))
EngineArgs(model={model!r}, enable_routed_experts=True).create_engine_config()
print("after", hooked(), pending())
"""


def test_engine_modules_imported_first_are_hooked_before_any_engine_starts() -> None:
    """A program (an RL framework's rollout worker) whose first vLLM import is AsyncLLM's
    module: it is mid-import when our hooks install, so its patches wait, and they are
    applied when the engine's configuration is made, before any engine exists."""
    from vllm_artifact.selftest.tiny_models import ensure_tiny_model

    code = ENGINE_MODULE_FIRST.format(model=str(ensure_tiny_model("qwen3-moe-8x2")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert "before [False, False, False] ['vllm.v1.engine.async_llm']" in lines, out.stdout
    assert lines[-1] == "after [True, True, True] []", out.stdout


def test_offline_handles_are_read_once_published_and_the_rest_at_the_end(
    store: ShmStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An offline run reads a handle at the first engine step that finds all its objects in
    the store, in finishing order; the end reads what is left (the steps' unpublished ones and
    outputs no step showed), each handle exactly once."""
    reads: list[str] = []
    real = keys_answer.handle_failure

    def counted(request_id: str, h: R3Keys) -> Any:
        reads.append(request_id)
        return real(request_id, h)

    monkeypatch.setattr(keys_answer, "handle_failure", counted)
    rows = np.arange(32 * 8, dtype=np.uint8).reshape(32, 4, 2) % 8
    published = full_block_keys(NS, [b"f", b"g"])
    late = full_block_keys(NS, [b"h"])
    later = full_block_keys(NS, [b"i"])
    store.put_blocks(published, rows, 0)
    first = finished_output("cmpl-first-0", [handle(store, published, rows)])
    second = finished_output("cmpl-second-0", [handle(store, late, rows[:16])])
    third = finished_output("cmpl-third-0", [handle(store, later, rows[16:])])
    unseen = finished_output("cmpl-unseen-0", [handle(store, published, rows)])
    running = SimpleNamespace(request_id="cmpl-run-0", finished=False, outputs=[])
    run = keys_answer.OfflineHandles()
    run.step_done([first, running])
    assert reads == []  # queued: its last objects come with the next step
    run.step_done([second])
    assert reads == ["cmpl-first-0"]
    run.step_done([third])  # second is unpublished: it and everything after it wait
    assert reads == ["cmpl-first-0"]
    store.put_blocks(late, rows[:16], 0)
    run.step_done([])
    assert reads == ["cmpl-first-0", "cmpl-second-0"]  # third never published
    run.finish([first, second, third, unseen])
    assert reads == ["cmpl-first-0", "cmpl-second-0", "cmpl-third-0", "cmpl-unseen-0"]
    for output in (first, second, unseen):
        assert output.outputs[0].finish_reason == "length"
    failure = r3_failure(third.outputs[0].stop_reason)
    assert failure is not None and failure.reason == "missing"


def test_an_offline_run_checks_objects_digests_from_envelopes_alone(
    store: ShmStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handles with the objects' digest (the engine's usual) are answered from the objects'
    envelopes at the first step that finds them all published: no payload is read, and one
    whose objects hold another request's routing still fails closed (a read says why)."""
    payload_reads: list[int] = []
    real = ShmStore.read_into

    def counted(self: ShmStore, keys: Any, out: Any, **kwargs: Any) -> Any:
        payload_reads.append(len(keys))
        return real(self, keys, out, **kwargs)

    monkeypatch.setattr(ShmStore, "read_into", counted)
    rows = np.arange(32 * 8, dtype=np.uint8).reshape(32, 4, 2) % 8
    keys = full_block_keys(NS, [b"j", b"k"])
    late = full_block_keys(NS, [b"l"])
    store.put_blocks(keys, rows, 0)
    theirs = rows.copy()
    theirs[20, 2, 1] = (theirs[20, 2, 1] + 1) % 8
    own = finished_output("cmpl-own-0", [handle(store, keys, rows, digest="objects")])
    other = finished_output("cmpl-other-0", [handle(store, keys, theirs, digest="objects")])
    later = finished_output("cmpl-later-0", [handle(store, late, rows[:16], digest="objects")])
    run = keys_answer.OfflineHandles()
    run.step_done([own, other, later])
    store.put_blocks(late, rows[:16], 0)
    run.step_done([])
    run.finish([own, other, later])
    for output in (own, later):
        assert output.outputs[0].finish_reason == "length"
    assert other.outputs[0].finish_reason == "error"
    failure = r3_failure(other.outputs[0].stop_reason)
    assert failure is not None and failure.reason == "collision"
    assert payload_reads == [2]  # the refused handle's read, for its message
