"""GPU-probe stand-in (not vLLM code) for ``torch.ops._C_cache_ops.swap_blocks_batch``, the one
compiled op vLLM 0.32's native CPU KV offloading calls on CUDA (``vllm/_custom_ops.py``
``swap_blocks_batch``, used by ``vllm/v1/kv_offload/cpu/gpu_worker.py`` for every GPU->CPU store
and for CPU->GPU loads its Triton kernel does not take). vLLM's compiled extension that defines
it cannot be carried to the GPU machine (docs/gpu.md).

It does what the op's docstring says: for each i, copy ``sizes[i]`` bytes from ``src_ptrs[i]``
to ``dst_ptrs[i]`` on the current CUDA stream (here one ``cudaMemcpyAsync`` per copy with
``cudaMemcpyDefault``, through the libcudart torch loaded, found by vLLM's own ctypes wrapper;
the compiled op batches them in one ``cuMemcpyBatchAsync``). ``is_src_access_order_any`` only
lets the driver reorder source reads; the plain stream order kept here is always safe.

Loaded into vLLM's worker as a ``worker_extension_cls`` (``cache_ops_stand_in.Registered``, with
this folder on ``PYTHONPATH``): importing the module registers the op, and the class adds a
``cache_ops_stand_in_calls`` method for ``collective_rpc``. Where the op already exists (an
install with vLLM's compiled extensions) nothing is registered.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from typing import Any

import torch

#: Calls and bytes copied by the stand-in in this process (the worker), for the report.
CALLS: dict[str, int] = {"calls": 0, "copies": 0, "bytes": 0}
_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the unified address space
_memcpy_async: Any = None


def _cudart() -> Any:
    """The libcudart torch loaded (vLLM's wrapper finds it in /proc/self/maps); failing that,
    the first one found beside torch or in the nvidia wheels, as _C_stable_libtorch.py does."""
    from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary

    try:
        return CudaRTLibrary().lib
    except (AssertionError, AttributeError, OSError):
        import glob
        import site

        folders = [os.path.join(os.path.dirname(torch.__file__), "lib")]
        for path in site.getsitepackages() + sys.path:
            folders += glob.glob(os.path.join(path, "nvidia", "*", "lib"))
        for folder in folders:
            for candidate in sorted(glob.glob(os.path.join(folder, "libcudart.so*"))):
                with contextlib.suppress(OSError):
                    return ctypes.CDLL(candidate)
        raise


def _memcpy() -> Any:
    global _memcpy_async
    if _memcpy_async is None:
        function = _cudart().cudaMemcpyAsync
        function.restype = ctypes.c_int
        function.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        _memcpy_async = function
    return _memcpy_async


def swap_blocks_batch(
    src_ptrs: torch.Tensor,
    dst_ptrs: torch.Tensor,
    sizes: torch.Tensor,
    is_src_access_order_any: bool = False,
) -> None:
    copy = _memcpy()
    stream = torch.cuda.current_stream().cuda_stream
    if CALLS["calls"] == 0:
        print(
            f"[gpuprobe-shim] first call of torch.ops._C_cache_ops.swap_blocks_batch "
            f"(pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )
    for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True):
        rc = copy(dst, src, size, _CUDA_MEMCPY_DEFAULT, stream)
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {rc} ({size} bytes)")
        CALLS["copies"] += 1
        CALLS["bytes"] += int(size)
    CALLS["calls"] += 1


def _register() -> bool:
    if hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
        return False  # vLLM's compiled op is there
    library = torch.library.Library("_C_cache_ops", "FRAGMENT")
    library.define(
        "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
        "bool is_src_access_order_any=False) -> ()"
    )
    library.impl("swap_blocks_batch", swap_blocks_batch, "CompositeExplicitAutograd")
    _LIBRARIES.append(library)  # a Library deregisters its ops when collected
    return True


_LIBRARIES: list[Any] = []
REGISTERED = _register()
CALLS["registered"] = int(REGISTERED)
print(
    f"[gpuprobe-shim] torch.ops._C_cache_ops.swap_blocks_batch "
    f"{'stand-in registered' if REGISTERED else 'exists, stand-in not used'} (pid {os.getpid()})",
    file=sys.stderr,
    flush=True,
)


class Registered:
    """The worker extension whose import registers the op; its method reports the calls."""

    def cache_ops_stand_in_calls(self) -> dict[str, int]:
        return dict(CALLS)
