"""Decode the ``routed_experts`` field of an HTTP response into a numpy array.

The server sends base64 of an ``.npy`` file written with ``allow_pickle=False``; decoding uses
pybase64 (an order of magnitude faster than the stdlib for multi-MiB payloads) and refuses
pickled content, so a hostile payload cannot execute code.
"""

from __future__ import annotations

import io

import numpy as np
import pybase64


def decode_routed_experts(payload: str | bytes) -> np.ndarray:
    """Return the ``[tokens, layers, top_k]`` expert-ID array carried by ``payload``."""
    raw = pybase64.b64decode(payload, validate=True)
    array = np.load(io.BytesIO(raw), allow_pickle=False)
    if array.ndim != 3:
        raise ValueError(f"routed_experts must be a 3-D array, got shape {array.shape}")
    return array
