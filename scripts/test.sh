#!/usr/bin/env bash
# README command 2: set up if needed, then ruff, mypy and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== setup: ${SECONDS} s"
VENV=.venv/bin
echo "== ruff"; "$VENV/ruff" check . && "$VENV/ruff" format --check .
echo "== mypy"; "$VENV/mypy" && "$VENV/mypy" benchmarks
echo "== pytest"; "$VENV/python" -m pytest -q -ra --durations=15 "$@"
echo "== total: ${SECONDS} s"
