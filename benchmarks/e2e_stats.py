"""Targets and paired-ratio statistics of the end-to-end benchmark (``bench_e2e.py``) and of
the pooling of its runs (``pool_e2e.py``): no heavy imports, so pooling needs no server code."""

from __future__ import annotations

from typing import Any

import numpy as np

#: ours/off must keep this share of throughput; ours/vLLM at least 1.
TARGET_VS_OFF = 0.97
TARGET_VS_VLLM = 1.00

#: Student's t, two-sided 95%, by degrees of freedom (scipy is not a dependency).
T_975 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14)


def round_blocks(rounds: int, instances: int) -> list[range]:
    """The rounds each set of freshly started servers runs (``bench_e2e --instances``)."""
    return [range(i * rounds // instances, (i + 1) * rounds // instances) for i in range(instances)]


def paired_ratio(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of paired ratios and its 95% confidence interval (t on the logs).

    Each ratio pairs configurations that met the same minutes of the machine (a round), so the
    machine's drift cancels in it; the interval says whether a difference is resolved at all.
    Which samples are independent is the caller's choice: rounds of one run (``bench_e2e``)
    or sets of servers (``pool_e2e``)."""
    logs = np.log(ratios)
    mean = float(logs.mean())
    if len(logs) < 2:
        return float(np.exp(mean)), float("nan"), float("nan")
    t = T_975[len(logs) - 2] if len(logs) - 2 < len(T_975) else 1.96
    half = t * float(logs.std(ddof=1)) / len(logs) ** 0.5
    return float(np.exp(mean)), float(np.exp(mean - half)), float(np.exp(mean + half))


def resolution(low: float, high: float, target: float) -> str:
    """Whether an interval settles a target: 'resolved' only if it lies on one side of it."""
    if np.isnan(low):
        return "not resolved: one sample has no CI"
    if not low <= target <= high:
        return "resolved"
    return "not resolved: CI contains target"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Median, first and third quartile."""
    q1, med, q3 = np.percentile(values, [25, 50, 75])
    return float(med), float(q1), float(q3)


def ratios(num: list[float], den: list[float]) -> list[float]:
    """Per-repetition ratios (each pair met the same moment of the machine)."""
    return [a / b for a, b in zip(num, den, strict=True)]


def ratio_table(
    series: dict[str, list[float]], pairs: list[tuple[str, str, str]], width: int = 50
) -> dict[str, dict[str, Any]]:
    """Print the per-repetition ratios ``series[num] / series[den]`` of each ``(num, den,
    label)`` (median, quartiles, geometric mean with its 95% interval); return them by
    ``"num/den"`` for the JSON."""
    heading = f"{'median':>8} {'q1':>8} {'q3':>8}  geo mean [95% CI]"
    print(f"\n  {'ratio, per repetition':<{width}} {heading}")
    table: dict[str, dict[str, Any]] = {}
    for num, den, label in pairs:
        per_rep = ratios(series[num], series[den])
        med, q1, q3 = quartiles(per_rep)
        geo, low, high = paired_ratio(per_rep)
        table[f"{num}/{den}"] = {
            "median": med,
            "q1": q1,
            "q3": q3,
            "geo_mean": geo,
            "ci95": [low, high],
        }
        figures = f"{med:8.2f} {q1:8.2f} {q3:8.2f}  {geo:.2f} [{low:.2f}, {high:.2f}]"
        print(f"  {label:<{width}} {figures}")
    return table
