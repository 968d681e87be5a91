"""The cells of ``tools/gpu/matrix.py``: which engines each starts (``matrix_jobs.py``, one
process each), with which prompts, and what must hold of their outputs for a PASS."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm_artifact.selftest.cases import LONG_PROMPT, REPEATING_PROMPT, SHORT_PROMPTS, CaseResult
from vllm_artifact.selftest.cases import agreement as case_agreement
from vllm_artifact.selftest.oracle import Agreement, hf_router_topk, routing_agreement
from vllm_artifact.selftest.runner import SELFTEST_MODEL, full_precision

HERE = Path(__file__).resolve().parent
JOBS = HERE / "matrix_jobs.py"
#: Prompt sets: the self-test's, and fresh long ones (several 64-token chunks each).
SELFTEST_STEPS = [
    {"name": "batch", "prompts": list(SHORT_PROMPTS), "max_tokens": 8},
    {"name": "chunked prefill", "prompts": [LONG_PROMPT], "max_tokens": 8},
    {"name": "prefix hit", "prompts": [LONG_PROMPT], "max_tokens": 8},
]


def long_prompt(tag: str, sentences: int = 30) -> str:
    return " ".join(
        f"{tag} sentence {i} routes token {i * 5 % 11} to layer {i % 4}." for i in range(sentences)
    )


@dataclass
class Verdict:
    status: str
    rows: int = 0
    equal: int = 0
    detail: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls, name: str, agreements: list[Agreement], problems: list[str], evidence: dict[str, Any]
    ) -> Verdict:
        result = CaseResult.of(name, agreements, *problems)
        status = "PASS" if result.status == "PASS" else "FAIL"
        found = [*problems, *([result.detail] if result.detail not in problems else [])]
        return cls(status, result.rows, result.equal, "; ".join(p for p in found if p), evidence)


@dataclass
class Context:
    out: Path
    model: Path
    engine_args: dict[str, Any]
    timeout: float
    cuda: bool
    roots: list[Path] = field(default_factory=list)

    @classmethod
    def prepare(
        cls, out: Path, engine_args: dict[str, Any], cache_dir: Path | None, timeout: float
    ) -> Context:
        """The self-test's process settings, inherited by every engine process."""
        import torch

        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # The jobs read worker state through collective_rpc(<function>) (loopback engines).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        cuda = torch.cuda.is_available()
        if cuda:
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        else:
            from vllm_artifact_testing.engine_env import apply_cpu_engine_env

            apply_cpu_engine_env()
        full_precision()
        from vllm_artifact.selftest.tiny_models import ensure_tiny_model

        model = ensure_tiny_model(SELFTEST_MODEL, cache_dir)
        return cls(out, model, engine_args, timeout, cuda)

    def root(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"vllm-artifact-matrix-{name}-", dir="/dev/shm"))
        self.roots.append(path)
        return path

    def cleanup(self) -> None:
        """Remove the cell's store roots from /dev/shm."""
        for path in self.roots:
            shutil.rmtree(path, ignore_errors=True)
        self.roots.clear()

    def engine(
        self,
        name: str,
        mode: str,
        root: Path,
        steps: list[dict[str, Any]],
        overrides: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Run one engine in a process of its own; returns what ``matrix_jobs.run`` recorded
        (or ``error`` and vLLM's ``root_cause`` from the engine's log)."""
        jobs = self.out / "jobs"
        jobs.mkdir(exist_ok=True)
        spec: dict[str, Any] = {
            "model": str(self.model),
            "mode": mode,
            "root": str(root),
            "engine_args": self.engine_args,
            "overrides": overrides or {},
            "steps": steps,
            "result": str(jobs / f"{name}.pkl"),
        }
        (jobs / f"{name}.json").write_text(json.dumps(spec, indent=2))
        Path(spec["result"]).unlink(missing_ok=True)
        log = self.out / f"{name}.log"
        began = time.monotonic()
        with log.open("w") as sink:
            try:
                process = subprocess.run(
                    [sys.executable, str(JOBS), str(jobs / f"{name}.json")],
                    env={**os.environ, **(env or {})},
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    timeout=self.timeout,
                )
                code: int | str = process.returncode
            except subprocess.TimeoutExpired:
                code = f"timed out after {self.timeout} s"
        path = Path(spec["result"])
        result: dict[str, Any] = (
            pickle.loads(path.read_bytes())
            if path.exists()
            else {"error": f"no result (exit {code})"}
        )
        if "error" in result:
            result["root_cause"] = root_cause(log)
        seconds = round(time.monotonic() - began, 1)
        state = result.get("error", f"engine start {result.get('engine_seconds')} s")
        now = time.strftime("%H:%M:%S", time.gmtime())
        print(f"[{now}]   {name}: {state}, {seconds} s in all (log {log})", flush=True)
        return result


def root_cause(log: Path) -> str:
    """The first exception line the engine's processes logged (the deepest cause; vLLM then
    wraps it in 'Worker failed with error ...' and 'Engine core initialization failed')."""
    prefix = re.compile(r"^\((\w+) pid=\d+\)\s*(?:[A-Z]+ [\d-]+ [\d:]+ \[[^\]]+\]\s*)?")
    pattern = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)(?::|$)")
    for raw in log.read_text(errors="replace").splitlines():
        found = prefix.match(raw.strip())
        text = raw.strip()[found.end() :] if found else raw.strip()
        if pattern.match(text) and "Engine core initialization failed" not in text:
            return f"{text} (in {found.group(1) if found else 'the job process'})"
    return ""


def as_output(record: dict[str, Any]) -> Any:
    """A job's record in the shape of vLLM's RequestOutput, for the self-test's oracle check."""
    choice = SimpleNamespace(
        **{k: record[k] for k in ("token_ids", "routed_experts", "finish_reason")}
    )
    return SimpleNamespace(prompt_token_ids=record["prompt_token_ids"], outputs=[choice])


def oracle_check(model: Path, result: dict[str, Any]) -> list[Agreement]:
    return [
        case_agreement(model, as_output(r)) for step in result["steps"] for r in step["outputs"]
    ]


def outputs(result: dict[str, Any], step: str) -> list[dict[str, Any]]:
    return next(s["outputs"] for s in result["steps"] if s["name"] == step)


def delta(result: dict[str, Any], step: str, key: str, group: str = "counters") -> float:
    found = next(s for s in result["steps"] if s["name"] == step)
    return found["after"][group].get(key, 0) - found["before"][group].get(key, 0)


def workers(result: dict[str, Any], key: str) -> list[Any]:
    return [w.get(key) for w in result["at_start"]["workers"]]


def failed(result: dict[str, Any], what: str) -> Verdict | None:
    if "error" not in result:
        return None
    return Verdict(
        "FAIL", detail=f"{what}: {result['error']} (root cause: {result.get('root_cause')})"
    )


def cell_bf16(context: Context) -> Verdict:
    overrides = {"dtype": "bfloat16", "disable_log_stats": False}
    ours = context.engine("bf16-ours", "ours", context.root("bf16"), SELFTEST_STEPS, overrides)
    # vLLM's own capture, our plugins (general and platform) excluded; on the CPU build the CPU
    # support plugin (Triton interpreter stand-ins) still loads, as in benchmarks/bench_e2e.py.
    plugins = "not_loaded"
    if not context.cuda:
        plugins += ",vllm_artifact_cpu_support"
    native = context.engine(
        "bf16-vllm",
        "native",
        context.root("bf16-vllm"),
        SELFTEST_STEPS,
        overrides,
        {"VLLM_PLUGINS": plugins},
    )
    for result, what in ((ours, "ours"), (native, "vLLM's own")):
        if (verdict := failed(result, what)) is not None:
            return verdict
    problems: list[str] = []
    loaded = [len(native["frontend_plugin_modules"]), *map(len, workers(native, "plugin_modules"))]
    if any(loaded):
        problems.append(f"our plugin is loaded in the vLLM-own engine: {loaded} modules")
    ours_loaded = [len(ours["frontend_plugin_modules"]), *map(len, workers(ours, "plugin_modules"))]
    native_connector = workers(native, "aux_output_connector")
    ours_connector = workers(ours, "aux_output_connector")
    if not all(str(c).startswith("vllm.") for c in native_connector):
        problems.append(f"vLLM-own engine runs {native_connector}")
    if not all(str(c).startswith("vllm_artifact.") for c in ours_connector):
        problems.append(f"our engine runs {ours_connector}")
    rows = equal = dense_rows = 0
    info: dict[str, list[Agreement]] = {"ours": [], "vllm": []}
    for step in ("batch", "chunked prefill", "prefix hit"):
        for a, b in zip(outputs(ours, step), outputs(native, step), strict=True):
            count, same, dense, problem = compare_with_vllm(context.model, a, b, info)
            rows, equal, dense_rows = rows + count, equal + same, dense_rows + dense
            if problem:
                problems.append(f"{step}: {problem}")
    hit = outputs(ours, "prefix hit")[0]
    if not hit["num_cached_tokens"] or not outputs(native, "prefix hit")[0]["num_cached_tokens"]:
        problems.append("the repeated prompt was not a prefix-cache hit in both engines")
    hit_reads = delta(ours, "prefix hit", "reads", "connector")
    if hit_reads <= 0:
        problems.append("our prefix hit's R3 was not read from the store")
    if len(outputs(ours, "chunked prefill")[0]["prompt_token_ids"]) <= 64:
        problems.append("the long prompt fits one 64-token chunk")
    if rows == 0 or equal != rows:
        problems.insert(0, f"{rows - equal} of {rows} rows differ from vLLM's own")
    evidence = {
        "dtype": f"ours {ours['config']['dtype']}, vLLM's own {native['config']['dtype']}",
        "dense-layer rows (ours the mark, vLLM's own 0)": dense_rows,
        "prefix hit": f"{hit['num_cached_tokens']} cached tokens, {hit_reads:.0f} objects read "
        "from our store",
        "connectors": f"ours {sorted(set(ours_connector))}, "
        f"vLLM's own {sorted(set(native_connector))}",
        "vllm_artifact.integration modules loaded (frontend, workers)": f"vLLM's own {loaded}, "
        f"ours {ours_loaded}",
        "VLLM_PLUGINS of vLLM's own engine": plugins,
        "fp32 oracle agreement (information)": {k: summed(v) for k, v in info.items()},
    }
    status = "PASS" if not problems else "FAIL"
    return Verdict(status, rows, equal, "; ".join(problems), evidence)


def summed(agreements: list[Agreement]) -> str:
    rows, equal = sum(a.rows for a in agreements), sum(a.equal for a in agreements)
    near = sum(a.near_ties for a in agreements)
    return f"{equal}/{rows} rows equal ({near} of the others near-ties)"


def compare_with_vllm(
    model: Path, ours: dict[str, Any], native: dict[str, Any], info: dict[str, list[Agreement]]
) -> tuple[int, int, int, str]:
    """Rows (token, layer) of our R3 equal to vLLM's own, dense layers accounted for: ours hold
    the dense mark (the dtype's largest value), vLLM's 0. Returns rows, equal, dense rows and
    the first problem."""
    a, b = ours["routed_experts"], native["routed_experts"]
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray):
        return 1, 0, 0, f"no R3 array: ours {type(a).__name__}, vLLM's {type(b).__name__}"
    rows = a.shape[0] * a.shape[1]
    if (
        ours["token_ids"] != native["token_ids"]
        or ours["prompt_token_ids"] != native["prompt_token_ids"]
    ):
        return rows, 0, 0, "token ids differ from vLLM's own"
    if a.shape != b.shape or a.dtype != b.dtype:
        return rows, 0, 0, f"R3 {a.shape} {a.dtype}, vLLM's own {b.shape} {b.dtype}"
    tokens = ours["prompt_token_ids"] + ours["token_ids"][:-1]
    oracle = hf_router_topk(model, tokens)
    moe, mark = oracle.moe_layers, int(np.iinfo(a.dtype).max)
    same = np.empty(a.shape[:2], dtype=bool)
    same[:, moe] = (a[:, moe] == b[:, moe]).all(axis=-1)
    same[:, ~moe] = (a[:, ~moe] == mark).all(axis=-1) & (b[:, ~moe] == 0).all(axis=-1)
    marked = b.copy()
    marked[:, ~moe] = mark  # vLLM's 0 in a dense layer (checked above) as the oracle expects it
    info["ours"].append(routing_agreement(a, oracle))
    info["vllm"].append(routing_agreement(marked, oracle))
    problem = ""
    if not same.all():
        t, layer = (int(v) for v in np.argwhere(~same)[0])
        problem = (
            f"token {t}, layer {layer}: ours {a[t, layer].tolist()}, vLLM's {b[t, layer].tolist()}"
        )
    return rows, int(same.sum()), int((~moe).sum()) * a.shape[0], problem


def cell_eagle(context: Context) -> Verdict:
    from vllm_artifact_testing.eagle_draft import build_bigram_eagle_draft

    prompts = [SHORT_PROMPTS[0], REPEATING_PROMPT, long_prompt("Eagle", 8)]
    draft = build_bigram_eagle_draft(context.model, context.out / "eagle-draft", prompts)
    overrides = {
        "speculative_config": {"method": "eagle", "model": str(draft), "num_speculative_tokens": 2},
        "disable_log_stats": False,
    }
    steps = [
        {"name": "drafts", "prompts": prompts, "max_tokens": 24},
        {"name": "repeat", "prompts": prompts, "max_tokens": 24},
    ]
    result = context.engine("eagle", "ours", context.root("eagle"), steps, overrides)
    if (verdict := failed(result, "EAGLE engine")) is not None:
        return verdict
    problems = []
    drafted = delta(result, "drafts", "vllm:spec_decode_num_draft_tokens")
    accepted = delta(result, "drafts", "vllm:spec_decode_num_accepted_tokens")
    if not 0 < accepted < drafted:
        problems.append(f"{accepted:.0f} of {drafted:.0f} drafts accepted: need some of each")
    speculators = workers(result, "speculator")
    if speculators != ["EagleSpeculator"]:
        problems.append(f"speculator {speculators}")
    reads = delta(result, "repeat", "reads", "connector")
    if reads <= 0:
        problems.append("the repeats' prefix R3 was not read from the store")
    for first, again in zip(outputs(result, "drafts"), outputs(result, "repeat"), strict=True):
        if first["token_ids"] != again["token_ids"] or not np.array_equal(
            first["routed_experts"], again["routed_experts"]
        ):
            problems.append("a repeat's tokens or R3 differ from the first run's")
    evidence = {
        "drafts": f"{accepted:.0f} of {drafted:.0f} accepted (first pass)",
        "speculator": speculators,
        "repeat": f"{reads:.0f} objects read from the store, cached tokens "
        f"{[o['num_cached_tokens'] for o in outputs(result, 'repeat')]}",
        "dtype": result["config"]["dtype"],
    }
    return Verdict.of("eagle", oracle_check(context.model, result), problems, evidence)


def cell_restart(context: Context) -> Verdict:
    from vllm_artifact_testing.chaos import check_root, store_names

    old = [LONG_PROMPT, SHORT_PROMPTS[0], long_prompt("Restart")]
    new = [long_prompt("After the restart"), SHORT_PROMPTS[1]]
    agreements: list[Agreement] = []
    problems: list[str] = []
    evidence: dict[str, Any] = {}
    for variant in ("clean", "sigkill"):
        root = context.root(f"restart-{variant}")
        steps: list[dict[str, Any]] = [{"name": "serve", "prompts": old, "max_tokens": 8}]
        if variant == "sigkill":
            steps.append(
                {
                    "name": "crash",
                    "prompts": [long_prompt(f"Crash {k}", 10) for k in range(4)],
                    "max_tokens": 800,
                    "crash": True,
                }
            )
        first = context.engine(f"restart-{variant}-1", "ours", root, steps)
        if (verdict := failed(first, f"{variant}: engine 1")) is not None:
            return verdict
        before = store_names(root)
        second_steps = [
            {"name": "old", "prompts": old, "max_tokens": 8},
            {"name": "new", "prompts": new, "max_tokens": 8},
            {"name": "repeat", "prompts": old + new, "max_tokens": 8},
        ]
        second = context.engine(f"restart-{variant}-2", "ours", root, second_steps)
        if (verdict := failed(second, f"{variant}: engine 2")) is not None:
            return verdict
        check = check_root(root)
        shutil.rmtree(root, ignore_errors=True)
        agreements += oracle_check(context.model, first) + oracle_check(context.model, second)
        recovered = second["at_start"]["connector"]["objects"]
        published = first["steps"][0]["after"]["connector"]["objects"]
        if check.stores != before or len(check.stores) != 1:
            problems.append(f"{variant}: stores {before} before engine 2, {check.stores} after")
        if check.leftovers or check.corrupt or not check.objects:
            problems.append(
                f"{variant}: scrub {check.objects} objects, {check.corrupt} corrupt, "
                f"leftovers {check.leftovers}"
            )
        if recovered < published:
            problems.append(
                f"{variant}: engine 2 found {recovered} objects, engine 1 had {published}"
            )
        if delta(second, "repeat", "reads", "connector") <= 0:
            problems.append(f"{variant}: engine 2's prefix hits were not read from the store")
        for a, b in zip(outputs(first, "serve"), outputs(second, "old"), strict=True):
            if a["token_ids"] != b["token_ids"] or not np.array_equal(
                a["routed_experts"], b["routed_experts"]
            ):
                problems.append(
                    f"{variant}: engine 2's R3 of an old prompt differs from engine 1's"
                )
        stop = "stopped cleanly"
        if "crash" in first:
            crash = first["crash"]
            stop = f"SIGKILLed {crash['killed_pids']} after {crash['published_before_kill']} more"
        evidence[variant] = (
            f"engine 1 published {published} objects, {stop}; engine 2 opened {check.stores} "
            f"(before: {before}) holding {recovered} objects, read "
            f"{delta(second, 'repeat', 'reads', 'connector'):.0f} for its prefix hits; scrub: "
            f"{check.objects} objects intact, {check.corrupt} corrupt, leftovers {check.leftovers}"
        )
    return Verdict.of("restart", agreements, problems, evidence)


#: The cells of this module (``matrix_kv_cells.py`` has those with a KV connector).
CELLS: dict[str, Callable[[Context], Verdict]] = {
    "bf16": cell_bf16,
    "eagle": cell_eagle,
    "restart": cell_restart,
}
