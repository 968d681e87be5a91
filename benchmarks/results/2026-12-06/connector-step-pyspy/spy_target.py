"""Drives ours' connectors alone through bench_connector_step.py's prefill-hits workload, for
py-spy (run from the repository root; see ../README.md)."""

import os
import shutil
import sys

sys.path.insert(0, "benchmarks")
import bench_connector_step as bench

root = f"/dev/shm/spy-{os.getpid()}"
os.mkdir(root, 0o700)
config, close = bench.ours(root, "prefill-hits")
try:
    config.run(40)  # warm-up
    config.run(1200)
finally:
    close()
    shutil.rmtree(root, ignore_errors=True)
