"""Environment for running the real vLLM 0.32 engine on a machine without a GPU.

Values follow docs/cpu.md: Model Runner V2 (capture lives there), a bounded CPU KV cache,
and Triton's interpreter (enabled by the vllm-artifact-cpu-support package).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

CPU_ENGINE_ENV: Mapping[str, str] = {
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TRITON_INTERPRET": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: Engine arguments every test engine shares: float32 so routing matches the transformers
#: oracle, a block size the CPU backend accepts, eager mode (torch.compile warm-up costs ~50 s
#: here and changes nothing we test).
ENGINE_KWARGS: Mapping[str, object] = {
    "dtype": "float32",
    "block_size": 32,
    "max_model_len": 2048,
    "enforce_eager": True,
    "enable_prefix_caching": True,
    "seed": 0,
}


def apply_cpu_engine_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the CPU engine variables (keeping values the caller already set); returns env."""
    env = os.environ if environ is None else environ
    for name, value in CPU_ENGINE_ENV.items():
        env.setdefault(name, value)
    return dict(env)


def engine_cli_args(kwargs: Mapping[str, object] = ENGINE_KWARGS) -> list[str]:
    """The same settings as ``vllm serve`` flags."""
    args: list[str] = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False:
            args += [flag, str(value)]
    return args
