"""Decode routed experts (R3) as a trainer receives them: over HTTP or offline.

The server sends base64 of an ``.npy`` file written with ``allow_pickle=False``; decoding uses
pybase64 (an order of magnitude faster than the stdlib for multi-MiB payloads) and refuses
pickled content, so a hostile payload cannot execute code. A keys-only handle is read from
the engine's store on this node (:mod:`vllm_artifact.client.reader`).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm_artifact.client.experts import RoutedExperts, dense_layers
from vllm_artifact.client.reader import read_r3_keys
from vllm_artifact.core.handoff import R3Keys
from vllm_artifact.core.npy import decode_npy_base64

__all__ = ["decode_r3", "decode_routed_experts"]

#: Upper bound on an ``.npy`` header we accept (numpy's own default limit).
_MAX_HEADER = 10000


def decode_routed_experts(payload: str | bytes) -> np.ndarray:
    """Return the ``[tokens, layers, top_k]`` expert-ID array carried by ``payload``.

    The array is a writable view of the decoded buffer (no second copy, unlike ``np.load``;
    decoded by :func:`vllm_artifact.core.npy.decode_npy_base64`): ~4 ms for a 32K-token
    DeepSeek-V3 sample (docs/benchmarks.md).
    """
    raw = decode_npy_base64(payload)
    header = io.BytesIO(raw[:_MAX_HEADER].data)
    try:
        version = np.lib.format.read_magic(header)
        readers: dict[tuple[int, int], Any] = {  # numpy's stubs lack max_header_size
            (1, 0): np.lib.format.read_array_header_1_0,
            (2, 0): np.lib.format.read_array_header_2_0,
        }
        read_header = readers.get(version)
        if read_header is None:
            raise ValueError(f".npy format version {version} is not supported")
        shape, fortran_order, dtype = read_header(header, max_header_size=_MAX_HEADER)
    except ValueError as error:
        raise ValueError(f"routed_experts is not an .npy payload: {error}") from None
    if dtype not in (np.uint8, np.uint16):
        raise ValueError(f"routed_experts must be uint8 or uint16, got {dtype}")
    count = int(np.prod(shape))
    if len(raw) - header.tell() != count * dtype.itemsize:
        raise ValueError(f"routed_experts payload does not hold {shape} {dtype} values")
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=header.tell())
    array = flat.reshape(shape, order="F" if fortran_order else "C")
    if array.ndim != 3:
        raise ValueError(f"routed_experts must be a 3-D array, got shape {array.shape}")
    return array


def decode_r3(source: Any) -> RoutedExperts:
    """R3 of one completion, from whatever the caller holds:

    * a base64 ``.npy`` payload (``str`` / ``bytes``);
    * an HTTP response choice: raw JSON (``dict``) or the ``openai`` client's choice object
      (``response.choices[i]``; ``routed_experts`` is an extra field there);
    * an offline ``CompletionOutput`` (``outputs[i].outputs[j]``) or its numpy array;
    * a keys-only handle (``routed_experts_format="keys"``: an ``R3Keys`` offline, its JSON
      text over HTTP), read from the engine's store on this node
      (:func:`vllm_artifact.client.read_r3_keys`, waiting up to its default timeout).
    """
    if isinstance(source, np.ndarray):
        experts = source
    elif _is_keys_handle(source):
        return read_r3_keys(source)
    elif isinstance(source, str | bytes):
        experts = decode_routed_experts(source)
    else:
        field = (
            source.get("routed_experts")
            if isinstance(source, Mapping)
            else getattr(source, "routed_experts", None)
        )
        if field is None:
            raise ValueError(
                "this choice carries no routed_experts: start the server with "
                "--enable-routed-experts (offline: LLM(..., enable_routed_experts=True)); only "
                "the terminal choice of a stream carries them, and a request that failed closed "
                "has none (its stop_reason says why: vllm_artifact.client.r3_failure)"
            )
        return decode_r3(field)
    return RoutedExperts(experts, dense_layers(experts))


def _is_keys_handle(source: object) -> bool:
    if isinstance(source, R3Keys):
        return True
    return isinstance(source, str | bytes) and source[:1] in ("{", b"{")
