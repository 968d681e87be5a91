"""Pool ``bench_e2e.py`` runs, with each set of freshly started servers as one sample.

Within one run the turns (``--turn``) make the rounds of one set of servers agree to 2-3%,
and a run's interval is Student's t over its rounds. But a set of server processes can be
persistently a few percent faster or slower than another of the same configuration, and runs
at other hours moved by ~3% (docs/benchmarks.md), so the rounds of one run are not
independent samples of that: an interval over rounds can "resolve" a difference that the next
run does not reproduce. Here every set of servers in every given JSON file contributes one
ratio per workload (the geometric mean of its rounds' paired ratios), and the interval is t
over those sets: wider, and honest about server-to-server and run-to-run variation.

Run: ``.venv/bin/python benchmarks/pool_e2e.py RUN.json [RUN.json ...] [--json OUT]`` (JSON
files of ``bench_e2e.py --json``; only runs of the three real configurations belong together).
``--json`` writes the pooled ratios in ``bench_e2e``'s layout, which ``plot_benchmarks.py``
draws.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e_stats import TARGET_VS_OFF, TARGET_VS_VLLM, paired_ratio, resolution, round_blocks

#: Ratios reported per set of servers: (numerator, denominator) configurations.
PAIRS = (("ours", "off"), ("ours", "vllm"), ("vllm", "off"))
TARGETS = {("ours", "off"): TARGET_VS_OFF, ("ours", "vllm"): TARGET_VS_VLLM}


@dataclass(frozen=True)
class ServerSet:
    """One set of freshly started servers of one run, for one workload."""

    run: str  # file name
    code: str
    date: str
    instance: int
    rounds: int
    ratios: dict[tuple[str, str], float]  # geometric mean of the set's per-round ratios


def server_sets(name: str, data: dict[str, Any]) -> dict[str, list[ServerSet]]:
    """Per workload, the sets of servers of one ``bench_e2e`` JSON file's ``data``."""
    blocks = round_blocks(int(data["rounds"]), int(data.get("instances") or 1))
    code = str(data.get("code", "?")).rsplit(" ", 1)[-1].strip("()")
    out: dict[str, list[ServerSet]] = {}
    for workload, body in data["workloads"].items():
        batches = body["batches"]
        tok_s = {
            c: [b["output_tokens"] / b["elapsed"] for b in batches[c]]
            for c in ("off", "vllm", "ours")
        }
        out[workload] = [
            ServerSet(
                run=name,
                code=code,
                date=str(data.get("date", "?")),
                instance=i + 1,
                rounds=len(block),
                ratios={
                    (a, b): paired_ratio([tok_s[a][r] / tok_s[b][r] for r in block])[0]
                    for a, b in PAIRS
                },
            )
            for i, block in enumerate(blocks)
            if len(block)
        ]
    return out


def run_starts(dates: list[str]) -> str:
    """``2026-12-01 09:45-13:29`` for ISO start times of one day, ``2026-12-01 09:45 -
    2026-12-02 00:19`` over several days (a title must stay one line), else the dates listed."""
    days = {d[:10] for d in dates}
    if all(len(d) >= 16 for d in dates):
        starts = sorted(d[:16].replace("T", " ") for d in dates)
        if len(days) == 1:
            return f"{days.pop()} {starts[0][11:]}-{starts[-1][11:]} (run starts)"
        return f"{starts[0]} - {starts[-1]} (run starts)"
    return " / ".join(sorted(d[:16] for d in dates))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="JSON files of bench_e2e.py --json")
    ap.add_argument("--json", type=Path, help="write the pooled ratios here (for plotting)")
    args = ap.parse_args()
    pooled: dict[str, list[ServerSet]] = {}
    runs = [json.loads(path.read_text()) for path in args.runs]
    for path, data in zip(args.runs, runs, strict=True):
        for workload, sets in server_sets(path.name, data).items():
            pooled.setdefault(workload, []).extend(sets)
    out: dict[str, Any] = {
        "pooled_from": [str(path) for path in args.runs],
        "date": run_starts([str(run.get("date", "?")) for run in runs]),
        "load_start": [min(run["load_start"][0] for run in runs)],
        "load_end": [max(run["load_end"][0] for run in runs)],
        "targets": {"vs_off": TARGET_VS_OFF, "vs_vllm": TARGET_VS_VLLM},
        "workloads": {},
    }
    out["samples"] = (
        "sets of servers: "
        + ", ".join(f"{w} {len(sets)}" for w, sets in pooled.items())
        + f" ({len(runs)} runs pooled)"
    )
    for workload, sets in pooled.items():
        print(f"\n{workload}: {len(sets)} sets of servers from {len({s.run for s in sets})} run(s)")
        print(
            f"  {'run':<24} {'code':<14} {'started':<17} set rounds"
            + "".join(f"{a + '/' + b:>11}" for a, b in PAIRS)
        )
        for s in sets:
            print(
                f"  {s.run[:24]:<24} {s.code[:14]:<14} {s.date[:16]:<17} {s.instance:>3} "
                f"{s.rounds:>6}" + "".join(f"{s.ratios[p]:11.3f}" for p in PAIRS)
            )
        ratios = out["workloads"].setdefault(workload, {"sets": len(sets), "ratios": {}})
        for pair in PAIRS:
            mean, low, high = paired_ratio([s.ratios[pair] for s in sets])
            if pair[0] == "ours":
                ratios["ratios"][pair[1]] = {
                    "paired": mean,
                    "paired_ci_low": low,
                    "paired_ci_high": high,
                }
            line = (
                f"  {pair[0]}/{pair[1]} over sets of servers: {mean:.3f} "
                f"(95% CI {low:.3f}-{high:.3f})"
            )
            target = TARGETS.get(pair)
            if target is not None:
                met = "PASS" if mean >= target else "MISS"
                line += f"; target >= {target:.2f}: {met}, {resolution(low, high, target)}"
            print(line)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"\npooled ratios written to {args.json}")


if __name__ == "__main__":
    main()
