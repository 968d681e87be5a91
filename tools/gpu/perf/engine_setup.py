"""What the benchmark's engines run and how the driver reads its options: the engines'
arguments on a GPU, the models it builds, ``--cpus`` and ``--repeat``."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

GPU_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": False,
    "max_model_len": 4096,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 8192,
    "enable_prefix_caching": True,
    "seed": 0,
    "gpu_memory_utilization": 0.25,
    "kv_cache_memory_bytes": 16 * 2**30,
    "compilation_config": {
        "mode": 0,
        "custom_ops": ["none"],
        "cudagraph_mode": "FULL",
        "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256],
    },
    "attention_backend": "TRITON_ATTN",
    "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
    "moe_backend": "triton",
    "disable_log_stats": False,
}


def with_prefill_graphs(engine_args: dict[str, Any]) -> dict[str, Any]:
    """``engine_args`` with full CUDA graphs also for batches above the decode sizes, up to
    ``max_num_batched_tokens`` (doubling): a prefill step then replays a graph instead of
    launching every kernel from the engine's main thread (a production install's compiled
    piecewise graphs spare it most of that; this harness's torch cannot compile for vLLM)."""
    compilation = dict(engine_args["compilation_config"])
    sizes = sorted(compilation["cudagraph_capture_sizes"])
    largest = int(engine_args["max_num_batched_tokens"])
    while sizes[-1] * 2 < largest:
        sizes.append(sizes[-1] * 2)
    compilation["cudagraph_capture_sizes"] = sorted({*sizes, largest})
    return {**engine_args, "compilation_config": compilation}


#: DeepSeek-V3's R3 shape: 58 MoE layers of 256 experts, top-8
_DSV3_R3 = {"num_experts": 256, "top_k": 8, "num_layers": 58, "max_position_embeddings": 8192}
#: the models ``perf_model`` builds (TinyModelSpec fields); dsv3's small hidden size loads
#: and runs quickly on a GPU, dsv3-cpu's smaller matrices fit a CPU
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "dsv3": dict(
        _DSV3_R3,
        name="perf-dsv3-shape",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "dsv3-cpu": dict(
        _DSV3_R3,
        name="perf-dsv3-shape-cpu",
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    ),
    "small": dict(
        name="perf-cpu",
        num_experts=16,
        top_k=4,
        num_layers=4,
        moe_intermediate_size=32,
        max_position_embeddings=8192,
    ),
}


def perf_model(cache: Path, shape: str) -> Path:
    """The benchmark's model, built once per machine by the product's tiny-model builder:
    ``dsv3`` has DeepSeek-V3's R3 shape (the GPU default), ``dsv3-cpu`` the same R3 shape
    with smaller matrices (where the connectors' per-step work is the same, the forward
    cheap enough for a CPU), ``small`` a 4-layer model (the CPU default: a quick check)."""
    from vllm_artifact.selftest.tiny_models import TinyModelSpec, build_from_spec, is_complete

    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {shape!r}")
    spec = TinyModelSpec(**MODEL_SHAPES[shape])
    target = cache / f"{spec.name}-{spec.digest()}"
    if not is_complete(target):
        started = time.monotonic()
        build_from_spec(spec, target)
        print(f"model built in {time.monotonic() - started:.0f} s: {target}", flush=True)
    return target


def parse_cpus(spec: str) -> set[int] | None:
    """``--cpus``: "" (no pinning), "auto" (the first 8 CPUs local to GPU 0) or "2-5,8"."""
    if not spec:
        return None
    if spec == "auto":
        try:
            bus = subprocess.run(
                ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", "0"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            domain, rest = bus.lower().split(":", 1)
            local = Path(f"/sys/bus/pci/devices/{domain[-4:]}:{rest}/local_cpulist").read_text()
            found = parse_cpus(local.strip()) or set()
        except (OSError, ValueError, subprocess.CalledProcessError) as error:
            print(f"GPU-local CPUs unknown ({error}); pinning to the first allowed", flush=True)
            found = os.sched_getaffinity(0)
        return set(sorted(found)[:8])
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def parse_repeat(text: str, workloads: list[str]) -> dict[str, int]:
    """``--repeat``: ``N`` for every workload, or ``workload=N,...`` (the others once)."""
    if "=" not in text:
        repeats = dict.fromkeys(workloads, int(text))
    else:
        repeats = dict.fromkeys(workloads, 1)
        for item in text.split(","):
            name, _, count = item.partition("=")
            if name not in repeats:
                raise ValueError(f"{name!r} is not one of the workloads run ({workloads})")
            repeats[name] = int(count)
    if min(repeats.values()) < 1:
        raise ValueError("a round runs each workload at least once")
    return repeats
