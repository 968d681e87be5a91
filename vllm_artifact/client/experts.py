"""What a trainer gets back: one completion's routed experts (R3) and its dense layers.

Dense (non-MoE) layers carry the dtype's largest value in every entry (``255`` for ``uint8``,
``65535`` for ``uint16``), never a routing decision: a token's top-k ids are distinct, so for
top-k >= 2 a routed row never repeats one id, and for top-1 models the server's dtype leaves
the largest value unused. :func:`dense_layers` finds them from the array alone.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["RoutedExperts", "dense_layers"]


class RoutedExperts(NamedTuple):
    """One completion's R3: ``experts[t, l, k]`` is the k-th expert token ``t`` was routed to
    in layer ``l``, for every layer in ``moe_layers``; ``dense_layers`` have no router."""

    experts: np.ndarray
    dense_layers: tuple[int, ...]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        dense = set(self.dense_layers)
        return tuple(i for i in range(self.experts.shape[1]) if i not in dense)


def dense_layers(experts: np.ndarray) -> tuple[int, ...]:
    """Layers whose every entry is the dense-layer mark (the dtype's largest value).

    An array without rows has no evidence: it reports no dense layer.
    """
    if experts.shape[0] == 0:
        return ()
    mark = np.iinfo(experts.dtype).max
    return tuple(int(i) for i in np.flatnonzero((experts == mark).all(axis=(0, 2))))
