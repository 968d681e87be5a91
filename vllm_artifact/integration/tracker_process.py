"""The engine's end of the tracker process (``--artifact-tracker process``).

Why a process: on an engine whose own thread bounds throughput (it launches an eager step's
kernels one at a time), rank zero's tracking and store writes, done on that thread or on
another thread of the process (the GIL), cost the step their whole CPU time. Done in a
process of their own while the engine launches the next step, they cost it a copy of the
step's rows into shared memory and a few small messages (``docs/design.md``, "Where R3's
work runs").

:class:`TrackerProcess` starts ``tracker_service.py`` with a socket and a :class:`RowRing`,
sends it each step's facts, started steps and finished steps (rows through the ring), and
takes back each finished step's :class:`StepResult` in order, its arrays read in place from
the step's slot, which stays the engine's until they are dropped (at most ``LEASED_SLOTS`` at
once; beyond that an answer's arrays are copied out). A step whose every request is in steady
decode is answered at once by the engine itself (``core/local_decode.py``) and the process's
answer to it, taken later, checked. If the process goes, every step
still expected fails its requests with :class:`TrackerProcessError` and the engine goes on;
the next step's facts start a new process (at most ``MAX_RESTARTS`` a minute),
which takes the store over and serves requests admitted from then on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np

from vllm_artifact.contract import StepResult
from vllm_artifact.core.failure import R3Failure
from vllm_artifact.core.handoff import StoreAddress
from vllm_artifact.core.local_decode import LocalDecode
from vllm_artifact.core.recycled_arrays import RecycledArrays
from vllm_artifact.core.row_ring import RowRing
from vllm_artifact.core.step_batch import StepBatch
from vllm_artifact.core.step_facts import HashRun, StepFacts
from vllm_artifact.errors import ArtifactError, TrackerProcessError
from vllm_artifact.integration.output_side import OutputSetup
from vllm_artifact.integration.tracker_service import FinishedStep, TrackerCounters

__all__ = ["CopiedStep", "TrackerProcess"]

logger = logging.getLogger("vllm.artifact.worker")

#: Steps whose rows may be in the ring at once (async scheduling keeps one or two in flight).
RING_SLOTS = 4
#: A ring slot holds this many times a step's rows (its answer's arrays come back there).
ANSWER_ROOM = 8
#: Slots whose answers' arrays the engine may read in place at once (the scheduler copies a
#: step's rows out within a step or two); the others carry the steps in flight.
LEASED_SLOTS = RING_SLOTS - 2
#: How long the process may take to open the store and answer.
START_TIMEOUT_S = 120.0
#: How long one step's answer may take before the process is taken for hung.
ANSWER_TIMEOUT_S = 60.0
#: A process that went is started again at once, but at most this many times a window of
#: ``RESTART_WINDOW_S`` (a process that keeps dying would stall the engine at every start).
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


def packed_hashes(hashes: Iterable[bytes]) -> Iterable[bytes]:
    """vLLM's ``PackedBlockHashes`` as our :class:`HashRun`; anything else (a list of hashes)
    as is."""
    data, size = getattr(hashes, "data", None), getattr(hashes, "item_size", None)
    if isinstance(data, bytes) and isinstance(size, int):
        return HashRun(data, size)
    return hashes


class CopiedStep(Protocol):
    """A started step whose rows the GPU copies to host memory (the worker connector's
    ``PendingArtifactStep``)."""

    seq: int
    request_ids: list[str]
    rows: np.ndarray | None

    @property
    def error(self) -> Exception | None: ...

    def copied(self, wait: bool = False) -> bool: ...

    def columns(self, rows: np.ndarray) -> dict[str, Any]: ...


class TrackerProcess:
    """The tracker process and the engine's messages to it (not thread-safe: the worker
    connector serializes calls)."""

    def __init__(self, setup: OutputSetup, *, max_rows: int) -> None:
        self._setup = setup
        # An answer's arrays are the rows of each prompt that ends in the step, its prefix
        # hit's included: several times the step's own rows. Memory is taken as it is
        # touched; larger answers travel in the pickle.
        slot_bytes = ANSWER_ROOM * max_rows * setup.layout.row_nbytes
        self._ring = RowRing.create(RING_SLOTS, slot_bytes)
        self._free_slots: list[int] = []
        self._slot_of: dict[int, int] = {}  # seq -> ring slot of a sent step
        self._leased: list[int] = []  # slots whose answers' arrays may still be read
        self._answers: dict[int, StepResult] = {}
        # Steady-decode steps the engine answers itself (core/local_decode.py): its answers
        # not yet returned, and those whose answer from the process is still to be checked.
        self._local = LocalDecode(setup.layout)
        self._local_answers: dict[int, StepResult] = {}
        self._unchecked: dict[int, StepResult] = {}
        self._late: dict[str, R3Failure] = {}  # failures found since the last step returned
        self.answered_here = 0  # steps the engine answered itself (tests, benchmarks)
        self._arrays = RecycledArrays()  # the answers' arrays (core/recycled_arrays.py)
        self._unsent: deque[CopiedStep] = deque()  # started steps, oldest first
        self._conn: Connection | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._gone: TrackerProcessError | None = None
        self._restarts: deque[float] = deque(maxlen=MAX_RESTARTS)  # when, latest last
        self._live: set[str] = set()  # requests the process tracks (lost if it goes)
        self._generation: int | None = None
        self.counters = TrackerCounters(0, 0, 0)
        self.address: StoreAddress = self._start()

    # ------------------------------------------------------------------ lifecycle

    def _start(self) -> StoreAddress:
        """Start the process and wait until its store is open; raise what it failed with."""
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        command = [
            sys.executable,
            "-c",
            # Not ``-m``: the module's classes must pickle under its own name, not __main__.
            "import sys; from vllm_artifact.integration.tracker_service import main; "
            "sys.exit(main(sys.argv[1:]))",
            str(theirs.fileno()),
            str(self._ring.fd),
            str(self._ring.slots),
            str(self._ring.slot_bytes),
        ]
        self._proc = subprocess.Popen(
            command, pass_fds=(theirs.fileno(), self._ring.fd), env=env, stdin=subprocess.DEVNULL
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._free_slots = [slot for slot in range(RING_SLOTS) if slot not in self._leased]
        self._slot_of.clear()
        self._conn.send(self._setup)
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop()
            raise TrackerProcessError(
                f"the R3 tracker process did not open its store within {START_TIMEOUT_S:.0f} s"
            )
        try:
            kind, answer = self._conn.recv()
        except (EOFError, OSError) as error:
            self._stop()
            raise TrackerProcessError(
                f"the R3 tracker process ended while starting (exit code "
                f"{self._proc.poll()}): see its log lines above"
            ) from error
        if kind != "ready":
            self._stop()
            if isinstance(answer, ArtifactError):
                raise answer
            raise TrackerProcessError(f"the R3 tracker process could not start: {answer}")
        logger.info("vllm-artifact: R3 tracker process %d started", self._proc.pid)
        return answer

    def _stop(self) -> None:
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        if conn is not None:
            conn.close()
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        """Let the process finish what it has and close the store."""
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(("close", None))
        self._stop()
        self._ring.close()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _went(self, error: BaseException) -> None:
        """The process is gone (or hung): fail what is expected of it, keep the engine up."""
        code = None if self._proc is None else self._proc.poll()
        why = str(error) or type(error).__name__
        self._gone = TrackerProcessError(
            f"the R3 tracker process ended (exit code {code}; {why}); R3 of requests it "
            "tracked is lost"
        )
        logger.error("vllm-artifact: %s", self._gone)
        self._local.clear()  # a new process has none of them in steady decode
        self._unchecked.clear()
        if self._proc is not None and code is None:
            self._proc.kill()
        self._stop()

    def _usable(self) -> bool:
        """The process is up, or was started again (``MAX_RESTARTS`` a window at most). A
        new process is told which requests the last one held: they fail."""
        if self._conn is not None:
            return True
        now = time.monotonic()
        if len(self._restarts) == MAX_RESTARTS and now - self._restarts[0] < RESTART_WINDOW_S:
            return False
        self._restarts.append(now)
        try:
            self._start()
        except Exception as error:
            logger.error("vllm-artifact: the R3 tracker process did not restart: %s", error)
            return False
        lost = TrackerProcessError(
            "the R3 tracker process that held this request's rows ended; R3 of the request is "
            "lost (the engine goes on: send the request again)"
        )
        return self._send_once(("lost", (sorted(self._live), R3Failure(lost.reason, str(lost)))))

    # ------------------------------------------------------------------ messages

    def _send_once(self, message: tuple[str, Any]) -> bool:
        if self._conn is None:
            return False
        try:
            self._conn.send(message)
        except OSError as error:
            self._went(error)
            return False
        return True

    def _send(self, message: tuple[str, Any]) -> bool:
        """Send ``message``; if the process is found gone, to a new one (if one starts)."""
        if self._usable() and self._send_once(message):
            return True
        return self._usable() and self._send_once(message)

    def begin(self, facts: StepFacts) -> None:
        """Send a step's facts, its block hashes in our own type (vLLM's would make the
        process import vLLM to read them)."""
        hashes = {rid: packed_hashes(h) for rid, h in facts.block_hashes.items()}
        facts = dataclasses.replace(facts, block_hashes=hashes)
        if facts.generation != self._generation:
            self._live.clear()  # the tracker forgets every request (prefix-cache reset)
            self._local.clear()
            self._generation = facts.generation
        self._local.forget(facts.admitted)
        self._local.forget(facts.finished)
        self._send(("begin", facts))  # a new process started here fails what the last held
        self._live.update(facts.admitted)
        self._live.difference_update(facts.finished)

    def step_started(self, request_ids: list[str]) -> None:
        self._send(("started", request_ids))

    def queue_step(self, step: CopiedStep) -> None:
        """A started step: sent once its rows have landed (:meth:`send_copied`)."""
        self._unsent.append(step)

    def send_copied(self, until: CopiedStep | None = None) -> None:
        """Send the started steps whose rows have landed, oldest first, stopping at the first
        still being copied; with ``until``, wait for each up to and including that one. Called
        at each step's start, so that the process works on the last step while the engine
        launches the next."""
        while self._unsent:
            step = self._unsent[0]
            if not step.copied(wait=until is not None):
                if until is None:
                    return
                # Never copied (its output was never collected): nothing of it can come.
                logger.warning("vllm-artifact: a step's rows were never copied; skipped")
            else:
                self._send_one(step)
            self._unsent.popleft()
            if step is until:
                return

    def _send_one(self, step: CopiedStep) -> None:
        rows, step.rows = step.rows, None  # the ring holds a copy; the pinned buffer goes
        if step.error is not None or rows is None:
            error = step.error or TrackerProcessError("a step without rows")
            failure = R3Failure(getattr(error, "reason", "internal"), str(error))
            self._answers[step.seq] = StepResult(entries=dict.fromkeys(step.request_ids, failure))
            return
        columns = step.columns(rows)
        if rows.dtype != self._setup.layout.dtype:  # only top-1 models with exactly 256 experts
            rows = rows.astype(self._setup.layout.dtype)
        local = self._answer_here(StepBatch(rows=rows, **columns))
        self._send_step(step.seq, rows, columns)
        if local is not None:
            self._local_answers[step.seq] = local
            if step.seq in self._slot_of:  # sent: the process's answer to it will be checked
                self._unchecked[step.seq] = local

    def _answer_here(self, step: StepBatch) -> StepResult | None:
        """The engine's own answer to a step of steady-decode requests only, else None (the
        process answers it, as it does a step after a disagreement)."""
        if self._late:
            return None
        try:
            return self._local.answer(step)
        except Exception:
            logger.exception("vllm-artifact: a decode step could not be answered here")
            self._local.clear()
            return None

    def step_result(self, step: CopiedStep) -> StepResult:
        """``step``'s answer: sent first if it was not yet (with every older step)."""
        if any(queued is step for queued in self._unsent):
            self.send_copied(until=step)
        answer = self._local_answers.pop(step.seq, None)
        if answer is None:
            answer = self.result(step.seq, step.request_ids)
        else:
            self.answered_here += 1
            self._take_ready_answers()  # check the engine's earlier answers, without waiting
        return self._with_late_failures(answer)

    def answer_at_hand(self, step: CopiedStep) -> bool:
        """Whether :meth:`step_result` can give ``step``'s answer without waiting: the step
        is sent first if it was not yet (with every older step), then the answers already
        there are taken. True too where none can come (the process gone)."""
        if any(queued is step for queued in self._unsent):
            self.send_copied(until=step)
        if step.seq in self._local_answers or step.seq in self._answers:
            return True
        self._take_ready_answers()
        return step.seq in self._answers or step.seq not in self._slot_of or self._conn is None

    def wait_for_answers(self, timeout: float) -> bool:
        """Wait until an answer can be read, or ``timeout``: False then. It only asks the
        connection whether it is readable, which the step thread's sends do not touch, so the
        caller holds no lock meanwhile. A connection found closed counts as readable
        (:meth:`step_result` then tells the step's requests)."""
        conn = self._conn
        if conn is None:
            return True
        try:
            return bool(conn.poll(timeout))
        except (OSError, ValueError, EOFError):  # closed meanwhile (shutdown), or gone
            return True

    def _with_late_failures(self, answer: StepResult) -> StepResult:
        """``answer`` with the failures of requests whose earlier step the engine answered
        and the process's answer then disagreed (``core/local_decode.py``)."""
        if not self._late:
            return answer
        late, self._late = self._late, {}
        if answer.decode_ids and any(i in late for i in answer.decode_ids):
            keep = [k for k, i in enumerate(answer.decode_ids) if i not in late]
            answer.decode_ids = [answer.decode_ids[k] for k in keep]
            answer.decode_token_starts = [answer.decode_token_starts[k] for k in keep]
            if answer.decode_rows is not None:
                answer.decode_rows = answer.decode_rows[keep]
        answer.entries.update(late)
        return answer

    def _take_ready_answers(self) -> None:
        """Take the answers already there (none is waited for)."""
        while self._conn is not None and self._slot_of and self._conn.poll(0):
            self._take_answer()

    def _send_step(self, seq: int, rows: np.ndarray, step: dict[str, Any]) -> None:
        """Hand over finished step ``seq`` (``step``: :class:`FinishedStep`'s other fields);
        if the process is gone, the step's answer is a failure (:meth:`result`)."""
        slot = self._free_slot()
        if slot is None:
            return
        self._ring.write(slot, rows)
        self._slot_of[seq] = slot
        # Not to a new process if this one is found gone: the step's requests were its own.
        self._send_once(("step", FinishedStep(seq=seq, slot=slot, num_rows=len(rows), **step)))

    def _free_slot(self) -> int | None:
        """A slot no step and no array uses (waiting for the oldest step's answer if every
        slot is in use); None if the process went meanwhile."""
        while self._conn is not None:
            self._reclaim()
            if self._free_slots:
                return self._free_slots.pop()
            self._take_answer()  # at least two slots hold steps: the oldest's answer frees one
        return None

    def _reclaim(self) -> None:
        """Free the leased slots whose arrays nothing refers to any more."""
        if self._leased:
            self._free_slots.extend(slot for slot in self._leased if not self._ring.leased(slot))
            self._leased = [slot for slot in self._leased if slot not in self._free_slots]

    def result(self, seq: int, request_ids: list[str]) -> StepResult:
        """Step ``seq``'s answer (waiting for it); its requests' failure if it cannot come."""
        while seq in self._slot_of and seq not in self._answers and self._conn is not None:
            self._take_answer()
        answer = self._answers.pop(seq, None)
        if answer is not None:
            return answer
        self._slot_of.pop(seq, None)
        gone = self._gone or TrackerProcessError("the R3 tracker process is not running")
        return StepResult(entries=dict.fromkeys(request_ids, R3Failure(gone.reason, str(gone))))

    def flush(self, timeout: float) -> None:
        """Wait until what was submitted so far is published (tests, counters)."""
        if not self._send(("flush", timeout)):
            return
        while self._conn is not None:
            kind, seq, answer, counters = self._receive(timeout + ANSWER_TIMEOUT_S)
            if kind == "flushed":
                self.counters = counters
                if answer is not None:
                    raise answer
                return
            if kind == "done":
                self._keep(seq, answer, counters)

    def _take_answer(self) -> None:
        received = self._receive(ANSWER_TIMEOUT_S)
        if received[0] == "done":
            self._keep(*received[1:])

    def _keep(
        self,
        seq: int,
        packed: tuple[bytes, list[tuple[int, int]] | None],
        counters: TrackerCounters,
    ) -> None:
        """Unpack step ``seq``'s answer: its arrays read in place from its slot, which stays
        leased until they are dropped, or (``LEASED_SLOTS`` leased already) copied out of it,
        which is free again."""
        data, spans = packed
        slot = self._slot_of.pop(seq, None)
        buffers = None
        self._reclaim()
        if spans and slot is not None and len(self._leased) < LEASED_SLOTS:
            buffers = self._ring.lease(slot, spans)
            self._leased.append(slot)
        else:
            if spans is not None:
                buffers = self._ring.copy_out(spans, self._arrays)
            if slot is not None:
                self._free_slots.append(slot)
        answer: StepResult = pickle.loads(data, buffers=buffers)
        self.counters = counters
        mine = self._unchecked.pop(seq, None)
        if mine is None:
            self._answers[seq] = answer
            self._local.learn(answer)
            return
        differ = LocalDecode.disagreements(mine, answer)
        if differ:
            logger.error(
                "vllm-artifact: the R3 tracker process answered %d requests of a decode step "
                "otherwise than the engine did (%s); they fail",
                len(differ),
                ", ".join(differ[:5]),
            )
            self._local.forget(differ)
            failure = R3Failure(
                "internal",
                "the R3 tracker process's rows of a decode step of this request differ from "
                "those the engine returned; its R3 is not trusted",
            )
            self._late.update(dict.fromkeys(differ, failure))

    def _receive(self, timeout: float) -> tuple[str, Any, Any, Any]:
        conn = self._conn
        if conn is None:
            return ("gone", None, None, None)
        try:
            if not conn.poll(timeout):
                raise TimeoutError(f"no answer within {timeout:.0f} s")
            return conn.recv()
        except Exception as error:  # gone, hung, or an answer that cannot be read
            self._went(error)
            return ("gone", None, None, None)
