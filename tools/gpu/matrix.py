"""GPU runtime-matrix cells the self-test does not cover, each checked against the oracle.

    python3 tools/gpu/matrix.py --engine-args JSON --out DIR [--cells bf16,eagle,offload,restart,pd]

* ``bf16``: the self-test's prompts (batch, chunked prefill, prefix hit) in bfloat16 with our
  plugin and with vLLM's own capture (our plugin excluded by ``VLLM_PLUGINS``), compared row by
  row (vLLM writes 0 in a dense layer where we write the dense mark); each one's agreement with
  the float32 oracle is reported as information.
* ``eagle``: EAGLE speculative decoding with the test tooling's tiny draft, float32, drafts both
  accepted and rejected, every row against the oracle.
* ``offload``: vLLM's native CPU KV offloading (``kv_offloading_size``, CUDA only): a prefix
  whose GPU KV was evicted comes back from the CPU tier, and its R3 from our store.
* ``restart``: an engine serves, stops (cleanly; then SIGKILLed), a second engine opens the same
  ``artifact_root`` and serves old and new prompts; the store scrubs clean.
* ``pd``: prefill/decode through vLLM's ``ExampleConnector``: a producer saves a prompt's KV, a
  consumer on the same store root loads it and reads the prompt's R3 from the store; the rows
  it was served and the rows it computed are each compared with the producer's. The consumer
  runs eager (``matrix_kv_cells.cell_pd`` says why).

Every engine runs in a process of its own (``matrix_jobs.py``), one after the other. Prints each
cell's rows equal / rows, its evidence and PASS, FAIL or NOT RUNNABLE (with vLLM's message);
writes ``matrix.json`` and one log per engine into ``--out``; exits 0 only if every cell that
ran passed. Settings and prompts are the self-test's (``vllm_artifact.selftest``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from matrix_cells import CELLS as PLAIN_CELLS
from matrix_cells import Context
from matrix_kv_cells import CELLS as KV_CELLS

_ALL = {**PLAIN_CELLS, **KV_CELLS}
#: Every cell, in the order a full run takes them.
CELLS = {name: _ALL[name] for name in ("bf16", "eagle", "offload", "restart", "pd")}


@dataclass
class Outcome:
    cell: str
    status: str  # PASS, FAIL or NOT RUNNABLE
    rows_equal: int = 0
    rows_total: int = 0
    detail: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)
    started: str = ""
    seconds: float = 0.0


def stamp() -> str:
    return time.strftime("%H:%M:%S", time.gmtime())


def run_cell(name: str, cell: Callable[[Context], Any], context: Context) -> Outcome:
    started, began = stamp(), time.monotonic()
    print(f"[{started}] cell {name}: start", flush=True)
    try:
        verdict = cell(context)
        outcome = Outcome(name, verdict.status, verdict.equal, verdict.rows, verdict.detail)
        outcome.evidence = verdict.evidence
    except Exception as error:  # a bug in the cell itself: a FAIL with its reason
        outcome = Outcome(name, "FAIL", detail=f"{type(error).__name__}: {error}")
    finally:
        context.cleanup()
    outcome.started, outcome.seconds = started, round(time.monotonic() - began, 1)
    print(f"[{stamp()}] {line(outcome)}", flush=True)
    for key, value in outcome.evidence.items():
        print(f"    {key}: {value}", flush=True)
    return outcome


def line(outcome: Outcome) -> str:
    rows = f"{outcome.rows_equal}/{outcome.rows_total}" if outcome.rows_total else "-"
    text = f"cell {outcome.cell:<8} rows equal {rows:>13}  {outcome.status}  ({outcome.seconds} s)"
    return text + (f"\n    {outcome.detail}" if outcome.detail else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-args", type=json.loads, default={}, metavar="JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--cells", default=",".join(CELLS), help=f"comma-separated, of {', '.join(CELLS)}"
    )
    parser.add_argument("--cache-dir", type=Path, help="where the tiny model is built")
    parser.add_argument("--job-timeout", type=float, default=900.0, help="seconds per engine")
    args = parser.parse_args(argv)
    cells = [c.strip() for c in args.cells.split(",") if c.strip()]
    unknown = [c for c in cells if c not in CELLS]
    if unknown or not isinstance(args.engine_args, dict):
        parser.error(f"unknown cells {unknown}" if unknown else "--engine-args: a JSON object")
    args.out.mkdir(parents=True, exist_ok=True)
    context = Context.prepare(args.out, args.engine_args, args.cache_dir, args.job_timeout)
    print(f"[{stamp()}] model {context.model}, engine args {json.dumps(args.engine_args)}")
    from vllm_artifact.selftest.runner import versions

    found = versions()
    outcomes = []
    for name in cells:  # matrix.json after each cell: a run cut short keeps what it found
        outcomes.append(run_cell(name, CELLS[name], context))
        write_report(args.out, found, args.engine_args, outcomes)
    print(f"\nvLLM {found.vllm}, torch {found.torch}, {found.device}, {found.driver}")
    for outcome in outcomes:
        print(line(outcome).splitlines()[0])
    failed = [o.cell for o in outcomes if o.status == "FAIL"]
    print("FAIL: " + ", ".join(failed) if failed else "PASS: every cell that ran")
    return 1 if failed else 0


def write_report(out: Path, found: Any, engine_args: dict[str, Any], outcomes: list[Any]) -> None:
    report = {
        "versions": asdict(found),
        "engine_args": engine_args,
        "cells": [asdict(o) for o in outcomes],
    }
    (out / "matrix.json").write_text(json.dumps(report, indent=2, default=_json) + "\n")


def _json(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
