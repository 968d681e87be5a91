"""Self-test: is R3 right on this install? (``python -m vllm_artifact.selftest``)

Builds a tiny random-weight MoE model with its own tokenizer (no model hub), starts an engine
with routed experts on over the vLLM, torch and accelerator at hand, runs the workloads R3 must
survive (chunked prefill, a prefix hit served from the store, n > 1 sampling, a stop string, a
dense layer, the keys path, speculative decoding where the install supports it) and compares
every row with the router top-k of a ``transformers`` forward pass of the same weights
(:mod:`.oracle`). The tiny-model builder (:mod:`.tiny_models`) and the oracle are the ones the
project's own tests use.
"""
