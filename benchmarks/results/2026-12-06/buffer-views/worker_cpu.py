"""Ours' connectors alone on bench_connector_step.py's prefill-hits workload: the worker step
thread's mean CPU per step, and that of the heavy steps (over 1 ms). Run from the repository
root: .venv/bin/python benchmarks/results/2026-12-06/buffer-views/worker_cpu.py LABEL"""

import os
import shutil
import statistics
import sys

sys.path.insert(0, "benchmarks")
import bench_connector_step as bench

root = f"/dev/shm/worker-cpu-{os.getpid()}"
os.mkdir(root, 0o700)
config, close = bench.ours(root, "prefill-hits")
try:
    config.run(40)  # warm-up
    config.run(600)
finally:
    close()
    shutil.rmtree(root, ignore_errors=True)
timed = config.worker_ms[-600:]
heavy = [ms for ms in timed if ms > 1.0]
print(
    f"{sys.argv[1]} worker CPU mean {statistics.fmean(timed):.3f} ms/step, "
    f"heavy steps {len(heavy)} mean {statistics.fmean(heavy):.3f} ms"
)
