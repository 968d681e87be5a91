"""``python -m vllm_artifact.selftest``: R3 of this install against a transformers forward pass.

Prints one line per case (rows equal / rows, near-ties among the unequal ones, PASS/FAIL) and
the versions it ran on; exits 0 only when every case that ran passed. A case the install cannot
run (speculative decoding without its kernels) is reported as such, not failed. Routing is
compared in float32 with full-precision matmuls (TF32 off, Triton's fp32 dots in IEEE mode):
a near-tie that TF32 flips is then a real difference, and is reported as a near-tie.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from vllm_artifact.selftest.cases import CASES, SPECULATIVE, CaseResult, EngineCase

SELFTEST_MODEL = "qwen3-moe-16x4-dense0"


@dataclass(frozen=True)
class Versions:
    python: str
    vllm: str
    torch: str
    vllm_artifact: str
    device: str
    driver: str


def versions() -> Versions:
    import importlib.metadata as metadata

    import torch
    import vllm

    device, driver = "CPU (" + (platform.processor() or platform.machine()) + ")", "-"
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
        driver = _nvidia_driver() or f"CUDA {torch.version.cuda}"
    return Versions(
        python=platform.python_version(),
        vllm=vllm.__version__,
        torch=torch.__version__,
        vllm_artifact=metadata.version("vllm-artifact"),
        device=device,
        driver=driver,
    )


def _nvidia_driver() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if out.returncode == 0 and out.stdout.strip():
            return "driver " + out.stdout.strip().splitlines()[0]
    return None


def full_precision() -> None:
    """fp32 with full-precision matmuls in the engine processes (set before they start) and
    in this process's oracle."""
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def engine_kwargs(root: Path) -> dict[str, Any]:
    import torch

    kwargs: dict[str, Any] = {
        "enable_routed_experts": True,
        "artifact_root": str(root),
        "dtype": "float32",
        "seed": 0,
        "max_model_len": 1024,
        "enable_prefix_caching": True,
        # Far below the long prompt's length: its prefill runs in chunks.
        "max_num_batched_tokens": 64,
        "max_num_seqs": 8,
    }
    if not torch.cuda.is_available():
        # vLLM's CPU build: the block size its attention accepts, no torch.compile warm-up.
        kwargs.update(block_size=32, enforce_eager=True)
    else:
        kwargs.update(gpu_memory_utilization=0.3)
    return kwargs


@contextlib.contextmanager
def engine(model: Path, root: Path, extra: dict[str, Any], **overrides: Any) -> Iterator[Any]:
    from vllm import LLM

    llm = LLM(str(model), **{**engine_kwargs(root), **extra, **overrides})
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def run(model: Path, root: Path, *, speculative: bool, extra: dict[str, Any]) -> list[CaseResult]:
    results: list[CaseResult] = []
    try:
        with engine(model, root, extra) as llm:
            for case in CASES:
                results.append(_run_case(case, llm, model, root))
    except Exception as error:  # the engine did not start: nothing could be checked
        detail = f"{type(error).__name__}: {str(error).strip().splitlines()[-1:]}"
        return [CaseResult.failed("engine start", detail)]
    if speculative:
        try:
            with engine(model, root, extra, **SPECULATIVE.engine_overrides) as llm:
                results.append(_run_case(SPECULATIVE, llm, model, root))
        except Exception as error:  # an install without the speculative kernels
            results.append(CaseResult.not_runnable(SPECULATIVE.name, error))
    return results


def _run_case(case: EngineCase, llm: Any, model: Path, root: Path) -> CaseResult:
    started = time.monotonic()
    try:
        result = case.run(llm, model, root)
    except Exception as error:
        result = CaseResult.failed(case.name, f"{type(error).__name__}: {error}")
    return result.timed(time.monotonic() - started)


def _vllm_series() -> str | None:
    """The installed vLLM's series (``0.32``), None if it is not one we hook."""
    from vllm_artifact.errors import VllmIncompatibleError
    from vllm_artifact.integration.hooks.versions import vllm_series

    try:
        return vllm_series()
    except VllmIncompatibleError:
        return None


def report(results: Sequence[CaseResult], found: Versions) -> str:
    lines = [
        f"vllm-artifact self-test: vLLM {found.vllm}, torch {found.torch}, "
        f"vllm-artifact {found.vllm_artifact}, Python {found.python}",
        f"device: {found.device}, {found.driver}",
        "",
        f"{'case':<34} {'rows equal':>15} {'near-ties':>9}  result",
    ]
    for r in results:
        rows = f"{r.equal}/{r.rows}" if r.rows else "-"
        near = str(r.near_ties) if r.rows else "-"
        lines.append(f"{r.name:<34} {rows:>15} {near:>9}  {r.status}")
        if r.detail:
            lines.append(f"    {r.detail}")
    passed = all(r.status != "FAIL" for r in results)
    skipped = [r.name for r in results if r.status == "not runnable"]
    verdict = "PASS: R3 equals the oracle in every case" if passed else "FAIL"
    if passed and skipped:
        verdict += " that ran; not runnable on this install: " + ", ".join(skipped)
    lines += ["", verdict]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_artifact.selftest", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--cache-dir", type=Path, help="where the tiny model is built")
    parser.add_argument(
        "--no-speculative", action="store_true", help="skip the speculative-decoding engine"
    )
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    parser.add_argument(
        "--engine-args",
        type=json.loads,
        default={},
        metavar="JSON",
        help='more LLM(...) keywords for every engine, e.g. \'{"attention_backend": '
        '"TRITON_ATTN"}\' (what your install needs to start an engine)',
    )
    args = parser.parse_args(argv)
    if not isinstance(args.engine_args, dict):
        parser.error("--engine-args must be a JSON object of LLM(...) keywords")

    if _vllm_series() == "0.32":  # R3 is captured by Model Runner V2, the only one in 0.34
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    if torch.cuda.is_available():
        # Engine processes are spawned, not forked: after the first engine this process has
        # touched CUDA, and a forked engine core then fails with "CUDA error: initialization
        # error" (seen on the H200).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    full_precision()
    from vllm_artifact.selftest.tiny_models import ensure_tiny_model

    model = ensure_tiny_model(SELFTEST_MODEL, args.cache_dir)
    root = Path(tempfile.mkdtemp(prefix="vllm-artifact-selftest-", dir="/dev/shm"))
    try:
        results = run(model, root, speculative=not args.no_speculative, extra=args.engine_args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    found = versions()
    print(report(results, found), flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"versions": asdict(found), "cases": [asdict(r) for r in results]}, indent=2)
            + "\n"
        )
    return 0 if all(r.status != "FAIL" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
