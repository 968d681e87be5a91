"""vLLM integration layer: options, startup validation and the hooks into vLLM 0.32.

Everything here may import vLLM; the pure core (``vllm_artifact.core``) must not.
"""
