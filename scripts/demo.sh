#!/usr/bin/env bash
# README command 1: set up if needed, build the tiny MoE model, serve it with routed experts on,
# send one completion, print the decoded R3 array, stop the server (--keep-serving: keep it up
# for examples/rl_rollout.py until Ctrl-C).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
