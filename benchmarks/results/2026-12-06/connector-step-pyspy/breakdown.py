"""Share of py-spy samples (raw format) inside the worker connector's begin_step and
process_output, per function (inclusive) and per leaf line: python breakdown.py spy.txt"""

import collections
import re
import sys

WORKER_CALLS = ("ArtifactWorkerConnector.begin_step", "ArtifactWorkerConnector.process_output")
inclusive: collections.Counter[str] = collections.Counter()
leaves: collections.Counter[str] = collections.Counter()
total = 0
with open(sys.argv[1]) as samples:
    lines = list(samples)
for line in lines:
    stack, _, count = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    if not any(f.startswith(WORKER_CALLS) for f in frames):
        continue
    n = int(count)
    total += n
    for name in {re.sub(r" \(.*", "", f) for f in frames}:
        inclusive[name] += n
    leaves[frames[-1]] += n
print(f"{total} samples inside the worker connector's begin_step and process_output")
print("inclusive, per function (ours' code and numpy):")
for name, n in inclusive.most_common(60):
    if "." in name or name.islower():
        print(f"  {100 * n / total:5.1f}%  {name}")
print("self, per line:")
for name, n in leaves.most_common(25):
    print(f"  {100 * n / total:5.1f}%  {name}")
