#!/usr/bin/env bash
# On the H200 machine (the device tool's `run`, carry [".gpu"]): install what .gpu/ holds into
# /tmp/site-VERSION, put the stand-ins in place, then run each PHASE; outputs land in $OUT.
#   bash tools/gpu/run.sh selftest            (vLLM 0.32.0)
#   VLLM_GPU=0.34.0 bash tools/gpu/run.sh registry selftest
# vLLM's Python runs on the machine's torch with Triton kernels and the few PyTorch
# stand-ins of tools/gpu/shims for compiled ops that cannot be carried (docs/gpu.md).
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# VLLM_GPU picks the carried vLLM (bash tools/gpu/assemble.sh VERSION built it here).
VLLM_GPU=${VLLM_GPU:-0.32.0}
SITE=/tmp/site-$VLLM_GPU
STAMP=$( (ls "$REPO/.gpu/whl"; md5sum "$REPO/.gpu/vllm-src-$VLLM_GPU.tgz" "$REPO/.gpu/distinfo.tgz") | md5sum | cut -c1-16)
if [[ "$(cat $SITE/.stamp 2>/dev/null)" != "$STAMP" ]]; then
    rm -rf $SITE
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target $SITE "$REPO"/.gpu/whl/*.whl || exit 1
    for part in vllm-src-$VLLM_GPU distinfo-vllm-$VLLM_GPU distinfo; do
        tar xzf "$REPO/.gpu/$part.tgz" -C $SITE || exit 1
    done
    echo "$STAMP" > $SITE/.stamp
fi
cp "$REPO"/tools/gpu/shims/_C_stable_libtorch.py "$REPO"/tools/gpu/shims/_moe_C_stable_libtorch.py \
    $SITE/vllm/
# Edits of vLLM's files where a compiled part is missing here (tools/gpu/patch_site.py says why).
python3 "$REPO/tools/gpu/patch_site.py" "$SITE" || exit 1
# Model Runner V2 is opt-in on 0.32, the only runner on 0.34 (which warns about the variable).
[[ $VLLM_GPU == 0.32.* ]] && export VLLM_USE_V2_MODEL_RUNNER=1
export PATH=$SITE/bin:$PATH PYTHONPATH=$SITE:$REPO:$REPO/tools/testing PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false VLLM_ARTIFACT_CACHE=/tmp/vllm-artifact-cache
# Engine settings the stand-ins need: Triton attention and MoE, PyTorch-native custom ops and
# norms, full CUDA graphs without torch.compile (the machine's torch is not vLLM's).
ENGINE_ARGS='{"attention_backend": "TRITON_ATTN", "moe_backend": "triton",
  "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]},
  "compilation_config": {"mode": 0, "custom_ops": ["none"], "cudagraph_mode": "FULL",
    "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]},
  "enforce_eager": false, "kv_cache_memory_bytes": 268435456}'
status=0
for phase in "$@"; do
    echo "== $phase ($(date -u +%H:%M:%S))"
    case $phase in
        info)
            nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
            python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
            ;;
        registry)  # the patch registry and the connector contract against the carried vLLM
            python3 -m pytest --noconftest -p no:cacheprovider -q -rf \
                tests/integration/test_patch_registry.py 2>&1 | tail -40 \
                | tee "$OUT/registry.txt" || status=1
            ;;
        selftest)  # full CUDA graphs (asynchronous scheduling as vLLM turns it on)
            python3 -m vllm_artifact.selftest --engine-args "$ENGINE_ARGS" \
                --json "$OUT/selftest.json" 2>&1 | tee "$OUT/selftest.log" | grep -v " INFO " \
                || status=1
            ;;
        selftest-process)  # as selftest, with --artifact-tracker process
            PROCESS=$(python3 -c 'import json, sys; a = json.loads(sys.argv[1]); a["artifact_tracker"] = "process"; print(json.dumps(a))' "$ENGINE_ARGS")
            python3 -m vllm_artifact.selftest --engine-args "$PROCESS" \
                --json "$OUT/selftest-process.json" 2>&1 | tee "$OUT/selftest-process.log" \
                | grep -v " INFO " || status=1
            ;;
        selftest-eager)  # no CUDA graphs
            EAGER=$(python3 -c 'import json, sys; a = json.loads(sys.argv[1]); a["enforce_eager"] = True; a["compilation_config"] = {"mode": 0, "custom_ops": ["none"]}; print(json.dumps(a))' "$ENGINE_ARGS")
            python3 -m vllm_artifact.selftest --engine-args "$EAGER" --json "$OUT/selftest-eager.json" \
                2>&1 | tee "$OUT/selftest-eager.log" | grep -v " INFO " || status=1
            ;;
        serve)  # vllm serve on loopback, the openai client, the oracle (tools/gpu/serve_check.py)
            MODEL=$(python3 -c 'from vllm_artifact.selftest.tiny_models import ensure_tiny_model as m; print(m("qwen3-moe-16x4-dense0"))')
            # not $CC: the machine exports CC, the C compiler Triton builds its launchers with
            COMPILATION=$(python3 -c 'import json, sys; print(json.dumps(json.loads(sys.argv[1])["compilation_config"]))' "$ENGINE_ARGS")
            TRITON_F32_DEFAULT=ieee python3 -m vllm.entrypoints.cli.main serve "$MODEL" \
                --host 127.0.0.1 --port 8321 --enable-routed-experts --dtype float32 \
                --enable-prompt-tokens-details --max-model-len 1024 \
                --attention-backend TRITON_ATTN --moe-backend triton \
                --ir-op-priority '{"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}' \
                -cc "$COMPILATION" --kv-cache-memory-bytes 268435456 > "$OUT/serve.log" 2>&1 &
            SERVER=$!
            for _ in $(seq 300); do
                python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8321/health")' \
                    2>/dev/null && break
                kill -0 $SERVER 2>/dev/null || break
                sleep 1
            done
            python3 tools/gpu/serve_check.py http://127.0.0.1:8321 "$MODEL" 2>&1 \
                | tee "$OUT/serve-check.txt" || status=1
            kill $SERVER; wait $SERVER
            ;;
        perf)  # off / vLLM's own / ours side by side, bf16, full CUDA graphs (tools/gpu/perf)
            # the driver writes into $OUT as it goes: a run cut short still brings its rounds back
            python3 tools/gpu/perf/floor.py | tee "$OUT/perf-floor.txt"
            # the card and the CPUs the figures come from (calls land on different machines)
            { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
              grep -m1 "model name" /proc/cpuinfo; nproc
              echo "hyperthread siblings: $(sort -u /sys/devices/system/cpu/cpu*/topology/thread_siblings_list | tr "\n" " ")"
            } > "$OUT/perf-machine.txt" 2>&1 || true
            # PERF_TIMEOUT (s) interrupts the driver, profiled rounds included, so that the tar
            # below still runs within the call's limit (at most 8 files come back untarred).
            timeout -k 20 -s INT "${PERF_TIMEOUT:-0}" \
            python3 tools/gpu/perf/driver.py --out "$OUT/perf" --rounds "${PERF_ROUNDS:-5}" \
                --deadline "${PERF_DEADLINE:-420}" ${PERF_FLAGS:-} 2>&1 | grep --line-buffered -v " INFO " \
                | tee "$OUT/perf.txt" || status=1
            tar czf "$OUT/perf.tgz" -C "$OUT/perf" . && rm -rf "$OUT/perf"
            ;;
        connector-step)  # the connectors' CPU per step on this host's CPUs, no GPU (beside perf's
            # step timers: what the same work costs here against the CPU machine)
            python3 tools/gpu/perf/floor.py | tee "$OUT/connector-step-floor.txt"
            python3 benchmarks/bench_connector_step.py ${CONNECTOR_STEP_FLAGS:---workload decode-batch} \
                2>&1 | grep -v " INFO " | tee "$OUT/connector-step.txt" || status=1
            ;;
        matrix)  # bf16 vs vLLM's own, EAGLE, native CPU KV offload, restart (tools/gpu/matrix.py)
            python3 tools/gpu/matrix.py --engine-args "$ENGINE_ARGS" --out "$OUT/matrix" \
                ${MATRIX_FLAGS:-} 2>&1 | tee "$OUT/matrix.log" | grep -v " INFO " || status=1
            # the engines' job specs and pickled results: matrix.json holds what they found,
            # and the device tool brings back no folder this deep
            rm -rf "$OUT/matrix/jobs"
            ;;
        mtp)  # MTP speculative decoding on the tiny GLM-4.5-style model (tools/gpu/mtp_check.py)
            python3 tools/gpu/mtp_check.py --engine-args "$ENGINE_ARGS" --json "$OUT/mtp.json" \
                2>&1 | tee "$OUT/mtp.log" | grep -v " INFO " || status=1
            ;;
        *) echo "unknown phase $phase"; status=2 ;;
    esac
done
exit $status
