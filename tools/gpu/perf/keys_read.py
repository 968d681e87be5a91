"""The ``ours+keys`` variant's other half: the keys handles of a round read from the store
after the round, outside its time, as a trainer on the node reads them
(``vllm_artifact.client.read_r3_keys``), so that their R3 is compared with the other
configurations' arrays and the reading's cost is shown beside the round's."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

#: the keys variant's lease (s): its handles are read right after their round
KEYS_LEASE_S = 30.0
#: and its store's size: the objects of the rounds within a lease stay pinned (about 20,000
#: objects a prefill round), beyond what the automatic size holds beside a 4 GiB KV cache
KEYS_CAPACITY = 4 << 30


def read_keys(outputs: list[Any]) -> tuple[dict[int, np.ndarray], dict[str, Any]]:
    """Each output's R3 read through its handle (by the output's ``id``; an output whose
    handle is missing or cannot be read is left out, so it counts as missing R3), and the
    reading's figures: seconds, bytes, handles read, the first error."""
    from vllm_artifact.client import read_r3_keys
    from vllm_artifact.core.handoff import R3Keys

    rows: dict[int, np.ndarray] = {}
    errors: list[str] = []
    nbytes = 0
    started = time.perf_counter()
    for output in outputs:
        handle = output.outputs[0].routed_experts
        if not isinstance(handle, R3Keys):
            errors.append(f"no keys handle but {type(handle).__name__}")
            continue
        try:
            experts = read_r3_keys(handle).experts
        except Exception as error:  # counted as missing R3; the first is shown
            errors.append(f"{type(error).__name__}: {error}")
            continue
        rows[id(output)] = experts
        nbytes += experts.nbytes
    seconds = time.perf_counter() - started
    figures = {"seconds": round(seconds, 4), "bytes": nbytes, "read": len(rows)}
    if errors:
        figures.update(failed=len(errors), first_error=errors[0])
    return rows, figures
