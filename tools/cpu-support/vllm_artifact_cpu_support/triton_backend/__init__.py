"""Triton backend ``cpu`` that runs every kernel in Triton's interpreter.

Triton imports this package while discovering backends (``import triton``), i.e. before any
kernel is decorated, which is the moment ``TRITON_INTERPRET`` must be set for ``@triton.jit``
to produce interpreted kernels.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
