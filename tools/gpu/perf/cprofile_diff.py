"""Where one configuration's engine main thread spends more than another's, function by function.

Reads two cProfile dumps of the same round (``driver.py --python-profile`` writes
``cprofile-<config>-<workload>.pstats``) and prints the functions whose own time
(``tottime``) and whose cumulative time differ most, with the number of engine steps
(``execute_model`` calls) so the difference reads as milliseconds per step; then the
cumulative time of the functions of our package (``vllm_artifact``) and of vLLM's routed
experts capture, which only the R3 configurations run (hooks that wrap a whole run left out).

    .venv/bin/python tools/gpu/perf/cprofile_diff.py cprofile-off-prefill.pstats \
        cprofile-ours-prefill.pstats [--top 30]
"""

from __future__ import annotations

import argparse
import pstats
from pathlib import Path

#: functions only an R3 configuration runs, shown by cumulative time
R3_MARKERS = ("vllm_artifact", "routed_experts_capturer", "aux_output_connector")

Key = tuple[str, int, str]


def load(path: Path) -> dict[Key, tuple[int, float, float]]:
    """function -> (calls, own seconds, cumulative seconds)."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    return {key: (value[1], value[2], value[3]) for key, value in stats.items()}


def name(key: Key) -> str:
    path, line, function = key
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    elif ("/work/" in path or "/vllm_artifact/" in path) and "vllm_artifact" in path:
        path = path[path.find("vllm_artifact") :]
    return f"{function} ({path}:{line})"


def steps(profile: dict[Key, tuple[int, float, float]]) -> int:
    """Engine steps in the round: calls of the model runner's execute_model."""
    return max(
        (calls for key, (calls, _, _) in profile.items() if key[2] == "execute_model"),
        default=1,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path, help="e.g. cprofile-off-prefill.pstats")
    parser.add_argument("other", type=Path, help="e.g. cprofile-ours-prefill.pstats")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    base, other = load(args.base), load(args.other)
    n_base, n_other = steps(base), steps(other)
    total_base = sum(own for _, own, _ in base.values())
    total_other = sum(own for _, own, _ in other.values())
    print(
        f"{args.base.name}: {total_base:.3f} s in {n_base} steps; {args.other.name}: "
        f"{total_other:.3f} s in {n_other} steps; difference "
        f"{(total_other - total_base) * 1e3 / max(n_other, 1):+.2f} ms per step"
    )
    for index, label in ((1, "own time (tottime)"), (2, "cumulative time")):
        print(f"== {label}: other minus base, ms per step of the other (largest first)")
        keys = set(base) | set(other)
        diffs = sorted(
            keys,
            key=lambda k: (
                -abs(other.get(k, (0, 0.0, 0.0))[index] - base.get(k, (0, 0.0, 0.0))[index])
            ),
        )
        for key in diffs[: args.top]:
            mine = other.get(key, (0, 0.0, 0.0))
            theirs = base.get(key, (0, 0.0, 0.0))
            delta = (mine[index] - theirs[index]) * 1e3 / max(n_other, 1)
            print(f"  {delta:+9.3f}  calls {theirs[0]:>7} -> {mine[0]:>7}  {name(key)[:150]}")
    print("== R3-only functions of the other, cumulative ms per step (largest first)")
    # (our hooks around vLLM's entry points, e.g. LLM._run_engine, hold the whole run: left out)
    ours = [
        (key, value)
        for key, value in other.items()
        if any(m in key[0] for m in R3_MARKERS) and value[2] < total_other / 2
    ]
    for key, (calls, _, cumulative) in sorted(ours, key=lambda kv: -kv[1][2])[: args.top]:
        print(f"  {cumulative * 1e3 / max(n_other, 1):9.3f}  calls {calls:>7}  {name(key)[:150]}")


if __name__ == "__main__":
    main()
