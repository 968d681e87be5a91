"""Compiler half of the interpreter-only ``cpu`` Triton backend: it never compiles.

With ``TRITON_INTERPRET=1`` Triton executes kernels in Python and never asks a backend to
compile; every method here therefore refuses loudly instead of pretending to work.
"""

from __future__ import annotations

from typing import Any, NoReturn

from triton.backends.compiler import BaseBackend, GPUTarget

_REFUSAL = (
    "vllm-artifact-cpu-support only provides Triton's interpreter (TRITON_INTERPRET=1); "
    "compiling Triton kernels for the CPU is not supported"
)


class InterpreterOnlyBackend(BaseBackend):
    """Registered as ``cpu`` so vLLM's CPU build keeps Triton enabled."""

    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return bool(target.backend == "cpu")

    def hash(self) -> str:
        return "vllm-artifact-cpu-interpreter"

    def parse_options(self, options: dict[str, Any]) -> NoReturn:
        raise RuntimeError(_REFUSAL)

    def add_stages(self, stages: dict[str, Any], options: object, language: Any) -> NoReturn:
        raise RuntimeError(_REFUSAL)

    def load_dialects(self, context: Any) -> None:
        return None

    def get_module_map(self) -> dict[str, Any]:
        return {}
