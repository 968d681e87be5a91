"""Ours' connectors alone on bench_connector_step.py's prefill-hits workload (40 warm-up
steps, then STEPS): prints the worker step thread's mean CPU per step and that of the heavy
steps (over 1 ms), and serves as py-spy's target. Run from the repository root:

    .venv/bin/python benchmarks/results/2026-12-06/ours_prefill_hits.py LABEL [STEPS]
"""

import os
import shutil
import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_connector_step as bench

steps = int(sys.argv[2]) if len(sys.argv) > 2 else 600
root = f"/dev/shm/ours-prefill-hits-{os.getpid()}"
os.mkdir(root, 0o700)
config, close = bench.ours(root, "prefill-hits")
try:
    config.run(40)  # warm-up
    config.run(steps)
finally:
    close()
    shutil.rmtree(root, ignore_errors=True)
timed = config.worker_ms[-steps:]
heavy = [ms for ms in timed if ms > 1.0]
print(
    f"{sys.argv[1]} worker CPU mean {statistics.fmean(timed):.3f} ms/step, "
    f"heavy steps {len(heavy)} mean {statistics.fmean(heavy):.3f} ms"
)
