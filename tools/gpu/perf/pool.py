"""Per-round throughput ratios pooled over several ``driver.py`` runs (each on its own machine).

    python tools/gpu/perf/pool.py RUN.json [RUN.json ...]

Each argument is a run's ``results.json`` (inside the ``perf.tgz`` run.sh packs). A round runs
the three configurations back to back on one machine, so its ratios are the side-by-side
figures; pooling rounds of several runs gives more of them than one device call can hold.
Profiled rounds (slowed by py-spy) are left out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PAIRS = (("ours", "off"), ("native", "off"), ("ours", "native"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    rounds: dict[str, dict[tuple[int, int], dict[str, float]]] = {}
    for index, path in enumerate(args.runs):
        for result in json.loads(path.read_text())["results"]:
            if result.get("profiled"):
                continue
            by_round = rounds.setdefault(result["workload"], {})
            by_round.setdefault((index, result["seed"]), {})[result["config"]] = result["out_tok_s"]
    print(f"per-round ratios of output tokens/s, {len(args.runs)} runs pooled")
    for workload, by_round in sorted(rounds.items()):
        for top, bottom in PAIRS:
            ratios = sorted(
                tps[top] / tps[bottom] for tps in by_round.values() if top in tps and bottom in tps
            )
            if len(ratios) < 2:
                continue
            low, _, high = statistics.quantiles(ratios, n=4)
            print(
                f"{workload:8s} {top}/{bottom}: median {statistics.median(ratios):.3f}"
                f"  quartiles {low:.3f}-{high:.3f}  min {ratios[0]:.3f} max {ratios[-1]:.3f}"
                f"  n={len(ratios)}"
            )


if __name__ == "__main__":
    main()
