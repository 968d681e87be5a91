"""GPU-probe SHIM (not vLLM code): stands in for vllm/_C_stable_libtorch*.so, which cannot be
carried. Registers PyTorch implementations of the few torch.ops._C ops the probe's path touches.
Every op defined here is listed in SHIMMED and logged when first called."""

import ctypes
import os
import sys

import torch
import torch.nn.functional as F

SHIMMED = []
CALLED = set()
_lib = torch.library.Library("_C", "FRAGMENT")


def _note(name):
    if name not in CALLED:
        CALLED.add(name)
        print(
            f"[gpuprobe-shim] first call of torch.ops._C.{name} (pid {os.getpid()})",
            file=sys.stderr,
            flush=True,
        )


def _define(schema, fn):
    name = schema.split("(")[0]
    _lib.define(schema)

    def wrapped(*args, **kwargs):
        _note(name)
        return fn(*args, **kwargs)

    _lib.impl(name, wrapped, "CompositeExplicitAutograd")
    SHIMMED.append(name)


def _silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def _rms_norm(out, x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = y.to(x.dtype)
    if weight is not None:
        y = y * weight
    out.copy_(y)


def _fused_add_rms_norm(x, residual, weight, eps):
    residual.add_(x)
    _rms_norm(x, residual, weight, eps)


_cudart = None


def _host_to_device_ptr(ptr):
    """cudaHostGetDevicePointer through libcudart when loadable; else the UVA identity."""
    global _cudart
    if _cudart is None:
        _cudart = False
        import glob

        cands = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart.so*"))
        import site

        for sp in site.getsitepackages() + sys.path:
            cands += glob.glob(os.path.join(sp, "nvidia", "cu*", "lib", "libcudart.so*"))
            cands += glob.glob(os.path.join(sp, "nvidia", "cuda_runtime", "lib", "libcudart.so*"))
        cands += ["libcudart.so"]
        for c in cands:
            try:
                _cudart = ctypes.CDLL(c)
                print(f"[gpuprobe-shim] libcudart: {c}", file=sys.stderr, flush=True)
                break
            except OSError:
                continue
    if _cudart:
        dptr = ctypes.c_void_p()
        rc = _cudart.cudaHostGetDevicePointer(ctypes.byref(dptr), ctypes.c_void_p(ptr), 0)
        if rc == 0:
            return dptr.value
        print(
            f"[gpuprobe-shim] cudaHostGetDevicePointer rc={rc}; using UVA identity",
            file=sys.stderr,
            flush=True,
        )
    return ptr


class _CAI:
    def __init__(self, ptr, nbytes, keep):
        self._keep = keep
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _get_cuda_view_from_cpu_tensor(cpu):
    assert cpu.device.type == "cpu", cpu.device
    if cpu.numel() == 0:
        return torch.empty(cpu.shape, dtype=cpu.dtype, device="cuda")
    assert cpu.is_pinned(), "UVA view needs pinned memory"
    storage = cpu.untyped_storage()
    base = storage.data_ptr()
    nbytes = storage.nbytes()
    dptr = _host_to_device_ptr(base)
    raw = torch.as_tensor(
        _CAI(dptr, nbytes, cpu), device=torch.device("cuda", torch.cuda.current_device())
    )
    typed = raw.view(cpu.dtype)
    return typed.as_strided(cpu.size(), cpu.stride(), cpu.storage_offset())


def _weak_ref_tensor(t):
    return t.as_strided(t.size(), t.stride(), t.storage_offset())


_define("silu_and_mul(Tensor(a!) result, Tensor input) -> ()", _silu_and_mul)
_define("rms_norm(Tensor(a!) result, Tensor input, Tensor? weight, float epsilon) -> ()", _rms_norm)
_define(
    "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor? weight, "
    "float epsilon) -> ()",
    _fused_add_rms_norm,
)
_define(
    "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor", _get_cuda_view_from_cpu_tensor
)
_define("weak_ref_tensor(Tensor input) -> Tensor", _weak_ref_tensor)

# Capability queries evaluated at import time (w8a8_utils etc.): no CUTLASS kernels here.
for _q in (
    "cutlass_scaled_mm_supports_fp4",
    "cutlass_scaled_mm_supports_fp8",
    "cutlass_scaled_mm_supports_block_fp8",
    "cutlass_group_gemm_supported",
    "mxfp4_experts_quant_supported",
):
    _define(f"{_q}(int cuda_device_capability) -> bool", lambda cap: False)


# Import-only: vllm.compilation's fusion passes (imported when EAGLE/MTP load their draft model)
# read these ops' .default at module level. With custom_ops ["none"] and compilation mode 0 no
# pass runs and no layer calls them; if one ever does, it fails loudly. Ops vLLM probes with
# hasattr (scaled_fp4_quant, per_token_group_fp8_quant, ...) stay undefined on purpose.
def _import_only(name):
    def fail(*args, **kwargs):
        raise RuntimeError(f"tools/gpu stand-in: torch.ops._C.{name} is defined for imports only")

    return fail


for _op in (
    "rotary_embedding",
    "fused_qk_norm_rope",
    "static_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "dynamic_per_token_scaled_fp8_quant",
    "rms_norm_static_fp8_quant",
    "fused_add_rms_norm_static_fp8_quant",
    "rms_norm_dynamic_per_token_quant",
    "silu_and_mul_quant",
    "silu_and_mul_per_block_quant",
):
    _define(f"{_op}(Tensor input) -> ()", _import_only(_op))

print(
    f"[gpuprobe-shim] vllm._C_stable_libtorch shim loaded: torch.ops._C.{SHIMMED}",
    file=sys.stderr,
    flush=True,
)
