"""The tracker process: rank zero's request tracking and store writes outside the engine.

Started by :class:`~vllm_artifact.integration.tracker_process.TrackerProcess`, which calls
:func:`main` with the socket's and the ring's file descriptors and the ring's geometry. It
opens the same output side the engine would (``output_side.py``) and applies the engine's
messages in the order they come: each step's scheduler facts, started steps, and finished
steps whose rows lie in the shared :class:`~vllm_artifact.core.row_ring.RowRing`; it answers
each finished step with its :class:`~vllm_artifact.contract.StepResult`. It never imports
vLLM, and it exits when the engine closes the socket (the engine's end, however it comes).
"""

from __future__ import annotations

import logging
import pickle
import signal
from multiprocessing.connection import Connection
from typing import NamedTuple

import numpy as np

from vllm_artifact.contract import StepResult
from vllm_artifact.core.buffer import copy_rows
from vllm_artifact.core.row_ring import RowRing
from vllm_artifact.core.schema import R3Layout
from vllm_artifact.core.step_batch import StepBatch
from vllm_artifact.core.step_facts import StepFacts, apply_step_facts
from vllm_artifact.core.tracker import RequestTracker
from vllm_artifact.integration.engine_store import record_weight_version
from vllm_artifact.integration.output_side import OutputSetup, OutputSide, open_output_side

__all__ = ["FinishedStep", "TrackerCounters", "serve"]

logger = logging.getLogger("vllm.artifact.tracker")


class FinishedStep(NamedTuple):
    """A finished step as sent to the tracker process: a :class:`StepBatch` whose rows are
    the first ``num_rows`` rows of ring slot ``slot``."""

    seq: int
    slot: int
    num_rows: int
    request_ids: list[str]
    token_starts: np.ndarray
    num_scheduled: np.ndarray
    row_starts: np.ndarray
    row_ends: np.ndarray
    sampled: np.ndarray


class TrackerCounters(NamedTuple):
    """The tracker's counters, sent with every step's answer (tests and metrics read them)."""

    reads: int
    adopted: int
    tails_published: int

    @classmethod
    def of(cls, tracker: RequestTracker | None) -> TrackerCounters:
        """``tracker``'s counters (zeros without one), wherever it runs."""
        if tracker is None:
            return cls(0, 0, 0)
        return cls(tracker.reads, tracker.adopted, tracker.tails_published)


class _Service:
    """The engine's messages applied to the output side, as the worker connector would."""

    def __init__(self, side: OutputSide, ring: RowRing, layout: R3Layout) -> None:
        self.side = side
        self.ring = ring
        self.layout = layout
        self.generation = 0

    def begin(self, facts: StepFacts) -> None:
        tracker = self.side.tracker
        if apply_step_facts(tracker, facts, self.generation):
            logger.info("vllm-artifact: weight version now %r", facts.weight_version)
            record_weight_version(self.side.store, facts.weight_version)
        self.generation = facts.generation

    def finished(self, step: FinishedStep) -> StepResult:
        tracker, layout = self.side.tracker, self.layout
        try:
            shape = (step.num_rows, *layout.row_shape)
            # The tracker keeps views of a step's rows; the slot is the engine's again soon.
            rows = copy_rows(self.ring.read(step.slot, shape, layout.dtype), tracker.arrays)
            # vLLM leaves dense layers 0 (expert 0's id): mark them, see core/schema.py.
            layout.mark_dense(rows)
            return tracker.step_finished(
                StepBatch(
                    step.request_ids,
                    step.token_starts,
                    step.num_scheduled,
                    step.row_starts,
                    step.row_ends,
                    step.sampled,
                    rows,
                )
            )
        except Exception as error:  # the step's requests fail; the process goes on
            logger.exception("vllm-artifact: a step's R3 could not be processed")
            return StepResult.unprocessed(step.request_ids, error)

    def counters(self) -> TrackerCounters:
        return TrackerCounters.of(self.side.tracker)


def pack_answer(
    result: StepResult, ring: RowRing, slot: int
) -> tuple[bytes, list[tuple[int, int]] | None]:
    """``result`` pickled with its arrays' bytes in ring slot ``slot`` (the step's rows were
    copied out of it already), or all in the pickle if they do not fit there."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(result, protocol=5, buffer_callback=buffers.append)
    spans = ring.write_buffers(slot, [buffer.raw() for buffer in buffers])
    if spans is None:
        return pickle.dumps(result, protocol=5), None
    return data, spans


def serve(conn: Connection, ring: RowRing) -> None:
    """Open the output side from the first message, then answer the engine until it goes."""
    setup: OutputSetup = conn.recv()
    try:
        side = open_output_side(setup)
    except Exception as error:
        conn.send(("error", error))
        return
    service = _Service(side, ring, setup.layout)
    conn.send(("ready", side.engine_store.address))
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:
                return
            if kind == "begin":
                service.begin(payload)
            elif kind == "lost":
                side.tracker.admit_lost(*payload)
            elif kind == "started":
                side.tracker.step_started(payload)
            elif kind == "step":
                result = service.finished(payload)
                packed = pack_answer(result, ring, payload.slot)
                conn.send(("done", payload.seq, packed, service.counters()))
            elif kind == "flush":
                flush_error: Exception | None = None
                try:
                    side.publisher.flush(timeout=payload)
                except Exception as failed:  # the engine raises it where flush was called
                    flush_error = failed
                conn.send(("flushed", None, flush_error, service.counters()))
            elif kind == "close":
                return
            else:
                raise ValueError(f"unknown message {kind!r}")
    finally:
        side.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="(R3 tracker) %(levelname)s %(asctime)s %(message)s"
    )
    # Ctrl-C reaches the whole process group: the engine shuts down and closes the socket,
    # which is this process's end; dying first would fail requests of a clean shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock_fd, ring_fd, slots, slot_bytes = (int(arg) for arg in argv)
    conn = Connection(sock_fd)
    ring = RowRing(ring_fd, slots, slot_bytes)
    try:
        serve(conn, ring)
    except (BrokenPipeError, ConnectionResetError):  # the engine went away
        return 0
    finally:
        ring.close()
        conn.close()
    return 0
