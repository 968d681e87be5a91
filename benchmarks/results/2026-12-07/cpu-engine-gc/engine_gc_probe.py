# mypy: ignore-errors
"""Runs inside the engine-core process (through ``LLM.collective_rpc``): counts every cyclic-GC
collection by generation and by the thread that paid for it, with its duration, and, at the
start of each young (gen0) collection, the types and allocation sites of the objects that
triggered it (gen0's content: tracked objects allocated and still alive since the last one),
leaving out those the CPU build's Triton interpreter made and those without a traceback."""

from __future__ import annotations

import collections
import gc
import threading
import time
import tracemalloc

_STATE: dict = {}


def _type_name(o) -> str:
    t = type(o)
    return f"{t.__module__}.{t.__qualname__}"


def _short(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "python3.11/"):
        i = filename.rfind(marker)
        if i >= 0:
            return filename[i + len(marker) :]
    return filename


def _site(o) -> str:
    tb = tracemalloc.get_object_traceback(o)
    if tb is None:
        return "?"
    frames = list(tb)[-5:]
    return " <- ".join(f"{_short(f.filename)}:{f.lineno}" for f in reversed(frames))


def _callback(phase, info) -> None:
    st = _STATE
    if not st.get("active"):
        return
    gen = info["generation"]
    thread = threading.current_thread().name
    if phase == "start":
        st["started"] = time.perf_counter()
        if gen == 0:
            objs = gc.get_objects(generation=0)
            try:
                for o in objs:
                    site = _site(o)
                    if "triton/" in site or site == "?":
                        # the CPU build's Triton interpreter (no GPU has it) and objects made
                        # in C with no traceback of their own
                        st["other"] += 1
                        continue
                    k = _type_name(o)
                    st["types"][k] += 1
                    st["sites"][(k, site)] += 1
                st["young"] += len(objs)
            finally:
                del objs
        return
    seconds = time.perf_counter() - st.pop("started", time.perf_counter())
    st["collections"][(gen, thread)] += 1
    st["seconds"][(gen, thread)] += seconds


def install(_=None) -> str:
    """Freeze what exists, start counting (tracemalloc for allocation sites)."""
    gc.collect()
    gc.freeze()
    tracemalloc.start(10)
    _STATE.update(
        active=False,
        types=collections.Counter(),
        sites=collections.Counter(),
        collections=collections.Counter(),
        seconds=collections.Counter(),
        young=0,
        other=0,
    )
    gc.callbacks.append(_callback)
    return f"frozen {gc.get_freeze_count()}"


def start(_=None) -> None:
    for key in ("types", "sites", "collections", "seconds"):
        _STATE[key].clear()
    _STATE["young"] = _STATE["other"] = 0
    _STATE["active"] = True


def stop(_=None) -> dict:
    _STATE["active"] = False
    return {
        "types": _STATE["types"].most_common(40),
        "sites": [[k, s, n] for (k, s), n in _STATE["sites"].most_common(400)],
        "collections": [[g, t, n] for (g, t), n in sorted(_STATE["collections"].items())],
        "seconds": [[g, t, s] for (g, t), s in sorted(_STATE["seconds"].items())],
        "young": _STATE["young"],
        "other": _STATE["other"],
    }
