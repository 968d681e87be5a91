"""Draw docs/benchmarks.png from the JSON files of bench_e2e.py and bench_terminal.py.

Left: end-to-end throughput ratios per workload (geometric mean of the paired per-round
ratios; whiskers: its 95% confidence interval; or, from ``pool_e2e.py --json``, the same over
sets of servers pooled from several runs) against the targets ours/off >= 0.97 and
ours/vLLM >= 1.00.
Right: terminal R3 of a 32K-token DeepSeek-V3-sized request (min of N runs) per allocator
regime against the 8 ms target, with ours/vLLM written over each group (target <= 1.25x).

Run: ``.venv/bin/python benchmarks/plot_benchmarks.py E2E.json TERMINAL.json [-o PNG]``
(needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after selecting the backend

YLIM = (0.7, 1.35)


def plot_e2e(ax: Any, e2e: dict[str, Any]) -> None:
    names = list(e2e["workloads"])
    width = 0.38
    for k, (ref, label, color) in enumerate(
        (("off", "ours / R3 off", "tab:blue"), ("vllm", "ours / vLLM's own R3", "tab:orange"))
    ):
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        ratios = [e2e["workloads"][n]["ratios"][ref] for n in names]
        # Paired geometric mean with its 95% interval (older JSON: ratio of medians, range).
        paired = all("paired" in r for r in ratios)
        low, high = ("paired_ci_low", "paired_ci_high") if paired else ("round_min", "round_max")
        values = [r["paired" if paired else "tok_s"] for r in ratios]
        lower = [max(v - r[low], 0.0) for v, r in zip(values, ratios, strict=True)]
        upper = [max(r[high] - v, 0.0) for v, r in zip(values, ratios, strict=True)]
        ax.bar(xs, values, width, label=label, color=color, yerr=[lower, upper], capsize=3)
        for x, v, r in zip(xs, values, ratios, strict=True):
            ax.text(
                x, YLIM[0] + 0.01, f"{v:.3f}", ha="center", va="bottom", fontsize=8, rotation=90
            )
            if r[high] > YLIM[1]:  # the whisker leaves the plot: say where it ends
                ax.text(
                    x,
                    YLIM[1] - 0.01,
                    f"up to {r[high]:.2f}",
                    ha="center",
                    va="top",
                    fontsize=7,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1},
                )
    targets = e2e["targets"]
    ax.axhline(targets["vs_off"], color="tab:blue", linestyle="--", linewidth=1)
    ax.axhline(targets["vs_vllm"], color="tab:orange", linestyle="--", linewidth=1)
    ax.text(len(names) - 0.5, targets["vs_off"], f" {targets['vs_off']:.2f}", va="top", fontsize=8)
    ax.text(len(names) - 0.5, targets["vs_vllm"], f" {targets['vs_vllm']:.2f}", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylim(*YLIM)
    ax.set_ylabel("output tokens/s ratio (higher is better)")
    if "samples" in e2e:  # pool_e2e.py's JSON: one sample per set of servers, pooled over runs
        samples, whiskers = e2e["samples"], "95% CI over sets of servers"
    else:
        paired = all("paired" in w["ratios"]["off"] for w in e2e["workloads"].values())
        samples = f"{e2e['rounds']} round(s)"
        whiskers = "95% CI of the paired geo-mean" if paired else "per-round range"
    ax.set_title(
        f"End to end, tiny MoE on 2 CPU cores, {samples}\n(dashed: targets; whiskers: {whiskers})",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper right")


def plot_terminal(ax: Any, term: dict[str, Any]) -> None:
    bars = (
        ("copy_enc", "numpy copy + numpy2base64", "tab:gray"),
        ("v_enc", "vLLM's path", "tab:orange"),
        ("s_enc", "ours", "tab:green"),
        ("v_served", "vLLM's path, as served", "tab:red"),
        ("s_served", "ours, as served", "tab:olive"),
    )
    regimes = list(term["regimes"])
    width = 0.16
    for k, (key, label, color) in enumerate(bars):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(regimes))]
        values = [term["regimes"][r]["results_ms"][key][0] for r in regimes]
        ax.bar(xs, values, width, label=label, color=color)
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=7)
    highest = max(term["regimes"][r]["results_ms"][key][0] for r in regimes for key, _, _ in bars)
    for i, regime in enumerate(regimes):
        r = term["regimes"][regime]["results_ms"]
        top = max(r[key][0] for key, _, _ in bars)
        ax.text(
            i,
            top + highest * 0.08,
            f"ours/vLLM {r['s_enc'][0] / r['v_enc'][0]:.2f}x",
            ha="center",
            fontsize=8,
        )
    ax.axhline(term["targets"]["total_ms"], color="black", linestyle="--", linewidth=1)
    ax.text(-0.5, term["targets"]["total_ms"], " 8 ms target", va="bottom", fontsize=8)
    ax.set_xticks(range(len(regimes)), [f"malloc: {r}" for r in regimes])
    ax.set_ylim(0, highest * 1.3)
    ax.set_ylabel("ms (min of runs; lower is better)")
    ax.set_title(
        f"Terminal R3, {term['tokens']} tokens x 58 layers x top-8 (14.5 MiB)\n"
        "materialize + base64 .npy (target: ours <= 1.25x vLLM's, <= 8 ms)",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper right")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("e2e", type=Path, help="bench_e2e.py --json output")
    ap.add_argument("terminal", type=Path, help="bench_terminal.py --json output")
    ap.add_argument("-o", "--output", type=Path, default=Path("docs/benchmarks.png"))
    args = ap.parse_args()
    e2e = json.loads(args.e2e.read_text())
    term = json.loads(args.terminal.read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    plot_e2e(left, e2e)
    plot_terminal(right, term)
    loads = [e2e["load_start"][0], e2e["load_end"][0]]
    loads += [r["load"][0] for r in term["regimes"].values()]
    fig.suptitle(
        f"vllm-artifact benchmarks, {e2e['date']}, 2 CPU cores shared with other jobs "
        f"(1-min load average {min(loads):.1f}-{max(loads):.1f} at the samples)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
