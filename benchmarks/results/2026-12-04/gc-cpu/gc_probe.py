import os, sys, time, json
mode = sys.argv[1]
os.environ["VLLM_GC_DEBUG"] = "1"
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
if mode == "native":
    os.environ["VLLM_PLUGINS"] = "none"
from vllm import LLM, SamplingParams
from vllm_artifact.selftest.tiny_models import ensure_tiny_model
model = str(ensure_tiny_model("qwen3-moe-16x4-dense0"))
kw = dict(model=model, dtype="float32", seed=0, max_model_len=1024, enable_prefix_caching=True,
          max_num_batched_tokens=8192, max_num_seqs=128, block_size=32, enforce_eager=True)
if mode == "ours":
    kw.update(enable_routed_experts=True, artifact_root="/dev/shm/gcx-root")
elif mode == "native":
    kw.update(enable_return_routed_experts=True)
def main():
    llm = LLM(**kw)
    params = SamplingParams(max_tokens=96, ignore_eos=True, temperature=0)
    for r in range(2):
        prompts = [{"prompt_token_ids": [(7 * i + j + r * 131) % 500 + 3 for j in range(64)]} for i in range(64)]
        t = time.perf_counter(); out = llm.generate(prompts, params, use_tqdm=False); dt = time.perf_counter() - t
        print(f"ROUND {mode} {r} {dt:.3f}s rows={sum(len(o.outputs[0].routed_experts) if getattr(o.outputs[0],'routed_experts',None) is not None else 0 for o in out)}", flush=True)

if __name__ == '__main__':
    main()
