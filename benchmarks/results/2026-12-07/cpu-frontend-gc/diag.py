# mypy: ignore-errors
# (the diagnostic as it ran, archived with its reports; not typed)
"""Which container objects does the offline frontend promote into gen2 per request, R3 off vs on?

Parent: runs one child process per config (off: our plugin not loaded, as tools/gpu/perf/driver.py
does; on: plugin loaded, enable_routed_experts=True, artifact_root under /dev/shm), then compares.
Child: LLM(...) on the repo's tiny MoE model, warm-up generate, gc.collect(); gc.freeze(), then a
gc.callbacks hook that at start/stop of every generation-1 collection diffs gen2's object ids: the
objects a gen1 collection adds to gen2 are exactly what it promoted (long_lived_pending's growth).
They are counted by type and, with tracemalloc, by allocation site.

usage: .venv/bin/python /tmp/gcdiag/diag.py [--model qwen3-moe-8x2|perf:small|perf:dsv3-cpu]
       [--rounds 3] [--prompts 64] [--prompt-len 256] [--max-tokens 16] [--configs off,on]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path("/work/main")
OUT = Path("/tmp/gcdiag")
sys.path[:0] = [str(REPO / "tools/testing"), str(REPO / "tools/gpu/perf")]


def tkey(o):
    t = type(o)
    return f"{t.__module__}.{t.__qualname__}"


def short(filename: str) -> str:
    for marker in ("site-packages/", "/work/main/", "python3.11/"):
        i = filename.rfind(marker)
        if i >= 0:
            return filename[i + len(marker) :]
    return filename


def site_of(o, tracemalloc) -> str:
    tb = tracemalloc.get_object_traceback(o)
    if tb is None:
        return "?"
    frames = list(tb)[-6:]  # oldest..most recent
    return " <- ".join(f"{short(f.filename)}:{f.lineno}" for f in reversed(frames))


def child(args) -> None:
    import tracemalloc

    import numpy as np
    from vllm_artifact_testing.engine_env import ENGINE_KWARGS, apply_cpu_engine_env

    apply_cpu_engine_env()
    from vllm import LLM, SamplingParams

    if args.model.startswith("perf:"):
        from engine_setup import perf_model

        model = perf_model(OUT / "models", args.model[5:])
    else:
        from vllm_artifact.selftest.tiny_models import ensure_tiny_model

        model = ensure_tiny_model(args.model)
    kwargs = {**ENGINE_KWARGS, "max_model_len": 1024, "disable_log_stats": False}
    root = None
    if args.child == "on":
        root = Path(f"/dev/shm/gcdiag-on-{os.getpid()}")
        kwargs.update(enable_routed_experts=True, artifact_root=str(root))
    t0 = time.perf_counter()
    llm = LLM(str(model), **kwargs)
    startup = time.perf_counter() - t0
    plugin_loaded = sum(m.startswith("vllm_artifact.") for m in sys.modules)

    rng = np.random.default_rng(0)

    def prompts(n, length):
        return [{"prompt_token_ids": rng.integers(3, 500, size=length).tolist()} for _ in range(n)]

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    warm = llm.generate(
        prompts(args.prompts, args.prompt_len),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        use_tqdm=False,
    )
    re0 = getattr(warm[0].outputs[0], "routed_experts", None)
    r3_info = (
        None
        if re0 is None
        else {
            "type": tkey(re0),
            "shape": list(re0.shape),
            "dtype": str(re0.dtype),
            "gc_tracked": gc.is_tracked(re0),
        }
    )
    del warm, re0
    llm.reset_prefix_cache()
    round_prompts = [prompts(args.prompts, args.prompt_len) for _ in range(args.rounds)]

    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    tracemalloc.start(12)

    st = {
        "start_ids": None,
        "gen1": 0,
        "gen0": 0,
        "gen2": 0,
        "pending": 0,
        "max_gen2": 0,
        "active": True,
    }
    promoted = collections.Counter()  # type -> objects promoted into gen2 by gen1 collections
    sites = collections.Counter()  # (type, site) -> count
    last_gen2 = collections.Counter()
    per_round = []

    def cb(phase, info):
        if not st["active"]:
            return
        gen = info["generation"]
        if phase == "stop":
            st[f"gen{gen}"] += 1
        if gen != 1:
            return
        objs = gc.get_objects(generation=2)
        try:
            if phase == "start":
                st["start_ids"] = np.sort(
                    np.fromiter(map(id, objs), dtype=np.int64, count=len(objs))
                )
                return
            ids = np.fromiter(map(id, objs), dtype=np.int64, count=len(objs))
            new = ~np.isin(ids, st["start_ids"], assume_unique=True)
            st["pending"] += int(new.sum())
            st["max_gen2"] = max(st["max_gen2"], len(objs))
            for i in np.flatnonzero(new):
                o = objs[i]
                k = tkey(o)
                promoted[k] += 1
                sites[(k, site_of(o, tracemalloc))] += 1
            last_gen2.clear()
            last_gen2.update(map(tkey, objs))
            st["start_ids"] = None
        finally:
            del objs

    # what R3 chunks arrive in the frontend: rows per chunk, and what the array's memory is
    chunk_stats = collections.Counter()
    core = llm.llm_engine.engine_core
    original_get_output = core.get_output

    def counted_get_output():
        out = original_get_output()
        chunk_stats["messages"] += 1
        for o in getattr(out, "outputs", None) or ():
            chunk_stats["outputs"] += 1
            re = getattr(o, "routed_experts", None)
            if re is not None:
                b, chain = re, []
                while getattr(b, "base", None) is not None and len(chain) < 4:
                    b = b.base
                    chain.append(type(b).__name__)
                rows = "1" if len(re) == 1 else ("<=16" if len(re) <= 16 else ">16")
                chunk_stats[f"chunk rows {rows} base {'>'.join(chain)}"] += 1
        return out

    core.get_output = counted_get_output

    # per engine step: every live tracked object not frozen (gen0+gen1+gen2), by type; the pool
    # a gen1 collection promotes from, whatever moment it happens at
    engine = llm.llm_engine
    original_step = engine.step
    live = collections.Counter()
    live_steps = collections.Counter()
    probe = []

    def sampled_step():
        outs = original_step()
        if st["active"]:
            objs = gc.get_objects()
            live.update(map(tkey, objs))
            live_steps["steps"] += 1
            live_steps["inflight"] += engine.output_processor.get_num_unfinished_requests()
            live_steps["objects"] += len(objs)
            if args.probe and live_steps["steps"] == args.probe and not probe:
                # mid-round: what holds the R3 objects (ndarrays are untracked: walk .base)
                rows = [o for o in objs if type(o).__name__ == "ArrivingRows"][:2]
                for ar in rows:
                    holders = [
                        tkey(x) for x in gc.get_referrers(ar) if x is not objs and x is not rows
                    ]
                    chains = []
                    for ch in list(ar) + list(ar._sources or []):
                        b, chain = ch, []
                        while getattr(b, "base", None) is not None:
                            b = b.base
                            chain.append(f"{type(b).__name__}(tracked={gc.is_tracked(b)})")
                        chains.append(" > ".join(chain))
                    probe.append(
                        {
                            "ArrivingRows len": len(ar),
                            "_sources len": len(ar._sources or []),
                            "held by": holders,
                            "chunk base chains": chains,
                            "_row_shape tracked": gc.is_tracked(ar._row_shape),
                            "_file tracked": gc.is_tracked(ar._file),
                        }
                    )
                frames = [o for o in objs if type(o).__name__ == "Frame"]
                fref = []
                for f in frames[:3]:
                    for x in gc.get_referrers(f):
                        if x is objs or x is frames:
                            continue
                        up = [
                            f"{tkey(y)}"
                            + (f"(len={len(y)})" if isinstance(y, (list, dict, tuple)) else "")
                            for y in gc.get_referrers(x)
                            if y is not objs and y is not frames and y is not fref
                        ]
                        fref.append(
                            f"{tkey(x)}(len={len(x) if hasattr(x, '__len__') else '-'}) "
                            f"held by {up[:4]}"
                        )
                probe.append(
                    {
                        "live Frames": len(frames),
                        "Frame referrers seen by gc (ndarray holders are invisible)": fref,
                    }
                )
                del rows, frames
            del objs
        return outs

    engine.step = sampled_step
    if args.threshold:
        gc.set_threshold(*args.threshold)
    gc.callbacks.append(cb)
    outputs = None
    t0 = time.perf_counter()
    for r, ps in enumerate(round_prompts):
        before = (st["gen1"], st["pending"], st["gen2"])
        rt = time.perf_counter()
        outputs = llm.generate(ps, params, use_tqdm=False)  # previous round's freed only now
        per_round.append(
            {
                "round": r,
                "s": round(time.perf_counter() - rt, 2),
                "gen1": st["gen1"] - before[0],
                "promoted": st["pending"] - before[1],
                "gen2_collections": st["gen2"] - before[2],
            }
        )
    timed = time.perf_counter() - t0
    st["active"] = False
    end_objs = gc.get_objects(generation=2)
    end_gen2 = collections.Counter(map(tkey, end_objs))
    end_len = len(end_objs)
    nreq = args.rounds * args.prompts

    # referrers of samples of the most promoted types (unfreeze so frozen holders are seen)
    gc.unfreeze()
    refs = {}
    skip = {id(end_objs), id(sys._getframe())}
    for k, _ in promoted.most_common(14):
        samples = [o for o in end_objs if tkey(o) == k][:3]
        out = []
        for o in samples:
            rs = [x for x in gc.get_referrers(o) if id(x) not in skip and x is not samples]
            lvl = []
            for x in rs[:4]:
                d = tkey(x)
                if isinstance(x, (dict, list, tuple)):
                    up = [
                        tkey(y)
                        for y in gc.get_referrers(x)
                        if id(y) not in skip and y is not rs and y is not samples
                    ][:3]
                    d += f" (held by {up})"
                lvl.append(d)
            desc = (
                repr(o)[:70]
                if not isinstance(o, (dict, list))
                else f"{type(o).__name__} len={len(o)}"
            )
            out.append({"obj": desc, "site": site_of(o, tracemalloc), "referrers": lvl})
        refs[k] = out
        del samples
    del end_objs

    result = {
        "config": args.child,
        "model": str(model),
        "plugin_modules": plugin_loaded,
        "startup_s": round(startup, 1),
        "timed_s": round(timed, 1),
        "frozen": frozen,
        "requests": nreq,
        "r3": r3_info,
        "gen0": st["gen0"],
        "gen1": st["gen1"],
        "gen2_collections": st["gen2"],
        "promoted_total": st["pending"],
        "promoted_per_request": st["pending"] / nreq,
        "max_gen2": st["max_gen2"],
        "final_gen2": end_len,
        "per_round": per_round,
        "promoted": promoted.most_common(),
        "last_gen1_gen2": last_gen2.most_common(40),
        "end_gen2": end_gen2.most_common(40),
        "sites": [[k, s, n] for (k, s), n in sites.most_common(80)],
        "referrers": refs,
        "outputs_alive": len(outputs),
        "chunk_stats": dict(chunk_stats),
        "threshold": gc.get_threshold(),
        "live_steps": dict(live_steps),
        "live": live.most_common(60),
        "probe": probe,
    }
    (OUT / f"result-{args.child}{args.tag}.json").write_text(json.dumps(result, indent=1))
    print("@@done", args.child, flush=True)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
    # SIGKILL this engine's own processes by pid (as tests/e2e/conftest.py kill_llm), then exit
    import psutil

    for proc in llm.llm_engine.engine_core.resources.engine_manager.processes:
        try:
            core = psutil.Process(proc.pid)
            for q in [*core.children(recursive=True), core]:
                q.kill()
        except psutil.NoSuchProcess:
            pass
    os._exit(0)


def report(configs, tag="", top=25) -> None:
    res = {c: json.loads((OUT / f"result-{c}{tag}.json").read_text()) for c in configs}
    for c, r in res.items():
        print(
            f"== {c}: model={Path(r['model']).name} plugin_modules={r['plugin_modules']} "
            f"r3={r['r3']} startup={r['startup_s']}s timed={r['timed_s']}s"
        )
        print(
            f"   frozen={r['frozen']} requests={r['requests']} gen0={r['gen0']} gen1={r['gen1']} "
            f"gen2_collections={r['gen2_collections']} promoted_into_gen2={r['promoted_total']} "
            f"({r['promoted_per_request']:.1f}/req) max_gen2={r['max_gen2']} "
            f"final_gen2={r['final_gen2']}"
        )
        print(f"   threshold={r['threshold']} chunks={r['chunk_stats']}")
        ls = r["live_steps"]
        print(
            f"   live sampling: steps={ls['steps']} "
            f"mean in-flight={ls['inflight'] / ls['steps']:.1f} "
            f"mean live non-frozen tracked objects={ls['objects'] / ls['steps']:.0f} "
            f"per in-flight request={ls['objects'] / max(ls['inflight'], 1):.2f}"
        )
        for pr in r["per_round"]:
            print("   ", pr)
        n = r["requests"]
        for label, key in (
            ("promoted by gen1 collections", "promoted"),
            ("gen2 at last gen1 stop", "last_gen1_gen2"),
            ("gen2 at end", "end_gen2"),
        ):
            print(f"   top {top} {label} (count, per request):")
            for k, v in r[key][:top]:
                print(f"     {v:8d} {v / n:8.2f}  {k}")
    if len(res) == 2:
        a, b = (res[c] for c in configs)
        la, lb = dict(a["live"]), dict(b["live"])
        ia, ib = a["live_steps"]["inflight"], b["live_steps"]["inflight"]
        print(
            "== live tracked objects per in-flight request (summed over steps), "
            f"{configs[1]} minus {configs[0]}:"
        )
        diff = {k: lb.get(k, 0) / ib - la.get(k, 0) / ia for k in set(la) | set(lb)}
        for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"   {d:+8.2f}  ({la.get(k, 0) / ia:7.2f} -> {lb.get(k, 0) / ib:7.2f})  {k}")
        off, on = (dict(res[c]["promoted"]) for c in configs)
        noff, non = res[configs[0]]["requests"], res[configs[1]]["requests"]
        print(f"== promoted into gen2 per request, {configs[1]} minus {configs[0]}:")
        diff = {k: on.get(k, 0) / non - off.get(k, 0) / noff for k in set(on) | set(off)}
        for k, d in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"   {d:+8.2f}  ({off.get(k, 0) / noff:7.2f} -> {on.get(k, 0) / non:7.2f})  {k}")
    for c, r in res.items():
        print(f"== {c}: top allocation sites of promoted objects (count, type, site)")
        for k, s, v in r["sites"][:30]:
            print(f"   {v:7d} {k}\n            {s}")
        print(f"== {c}: referrers of samples of the most promoted types")
        for k, samples in r["referrers"].items():
            for smp in samples[:2]:
                print(f"   {k}: {smp['obj']}\n      referrers: {smp['referrers']}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=["off", "on"])
    p.add_argument("--model", default="qwen3-moe-8x2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--configs", default="off,on")
    p.add_argument("--threshold", type=int, nargs=3, default=None, help="gc.set_threshold")
    p.add_argument("--tag", default="")
    p.add_argument("--probe", type=int, default=0, help="probe R3 holders at this step")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    if args.child:
        return child(args)
    configs = args.configs.split(",")
    if not args.report_only:
        for c in configs:
            env = dict(os.environ)
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # as the perf driver sets
            if c == "off":  # as driver.py: our plugin stays out of off (CPU support stays)
                env["VLLM_PLUGINS"] = "vllm_artifact_cpu_support"
            argv = [
                sys.executable,
                __file__,
                "--child",
                c,
                "--model",
                args.model,
                "--rounds",
                str(args.rounds),
                "--prompts",
                str(args.prompts),
                "--prompt-len",
                str(args.prompt_len),
                "--max-tokens",
                str(args.max_tokens),
            ]
            argv += ["--threshold", *map(str, args.threshold)] if args.threshold else []
            argv += [f"--tag={args.tag}", "--probe", str(args.probe)]
            with open(OUT / f"log-{c}{args.tag}.txt", "w") as log:
                rc = subprocess.run(
                    argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800
                ).returncode
            print(f"child {c}: rc={rc}, log {OUT}/log-{c}.txt", flush=True)
    report(configs, args.tag)


if __name__ == "__main__":
    main()
