"""Driver half of the interpreter-only ``cpu`` Triton backend.

``is_active()`` is False so Triton never selects it for a real launch; vLLM's CPU build only
checks that a backend named ``cpu`` exists.
"""

from __future__ import annotations

from typing import Any, NoReturn

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> NoReturn:
        raise RuntimeError("the interpreter-only cpu Triton backend has no C++ launcher")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")

    def get_benchmarker(self) -> NoReturn:
        raise RuntimeError("the interpreter-only cpu Triton backend cannot benchmark kernels")
