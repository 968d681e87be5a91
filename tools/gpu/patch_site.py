"""Edit the carried vLLM in place where it would import a compiled part that is not carried.

Run by ``tools/gpu/run.sh`` on the H200 machine after unpacking vLLM into SITE. Each edit is
a small, checked text substitution (the run stops if vLLM's text is not found, so a new vLLM
cannot be half-edited silently); the files stay vLLM's own otherwise. Idempotent.

* ``vllm_flash_attn/__init__.py`` (every version): raises ImportError without its FA2/FA3
  extensions; the engines here use TRITON_ATTN, so the package only has to import.
* ``model_executor/layers/fused_moe/router/gate_linear.py`` (0.34): the bf16x3 router GEMM
  imports ``cutlass`` (nvidia-cutlass-dsl, not carried); it is allowed only when that exists.
* ``model_executor/warmup/kernel_warmup.py`` (0.34): every CUDA warmup imports MiniMax-M3's
  CuTe-DSL kernels (``cutlass`` again) although it does nothing for other models; skipped.

    python3 tools/gpu/patch_site.py SITE
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARK = "tools/gpu/patch_site.py"

#: (file, what marks the code to edit, pattern, replacement): a file without the marker
#: (another vLLM version) is left alone; one with it must match the pattern.
EDITS: list[tuple[str, str, str, str]] = [
    (
        "vllm_flash_attn/__init__.py",
        "raise ImportError(",
        r"\n    raise ImportError\(\n.*?\n    \)\n",
        f"\n    pass  # {MARK}: no FA2/FA3 extension carried\n",
    ),
    (
        "model_executor/layers/fused_moe/router/gate_linear.py",
        "allow_bf16x3_router_gemm",
        r"self\.allow_bf16x3_router_gemm = \(\n(\s+)self\.is_unquantized\n",
        f"self.allow_bf16x3_router_gemm = (  # {MARK}: needs cutlass\n"
        r'\1__import__("importlib.util").util.find_spec("cutlass") is not None\n'
        r"\1and self.is_unquantized\n",
    ),
    (
        "model_executor/warmup/kernel_warmup.py",
        "The MSA kernels, and the CuTe DSL their modules import",
        r"\n(\s+)from vllm\.model_executor\.warmup\.minimax_m3_msa_warmup import \(\n"
        r"\s+minimax_m3_msa_warmup,\n\s+\)\n\n\s+minimax_m3_msa_warmup\(worker\)\n",
        f"\n\\1pass  # {MARK}: MiniMax-M3 warmup needs cutlass\n",
    ),
]


def main(site: Path) -> int:
    vllm = site / "vllm"
    for relative, marker, pattern, replacement in EDITS:
        path = vllm / relative
        text = path.read_text() if path.exists() else ""
        if MARK in text or marker not in text:
            continue
        text, count = re.subn(pattern, replacement, text, count=1, flags=re.S)
        if count != 1:
            print(f"{path}: the text to edit was not found; update {MARK}", file=sys.stderr)
            return 1
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
