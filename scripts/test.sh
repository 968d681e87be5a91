#!/usr/bin/env bash
# README command 2: set up if needed, then ruff, mypy and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "== setup: ${SECONDS} s"
VENV=.venv/bin
echo "== ruff"; "$VENV/ruff" check . && "$VENV/ruff" format --check .
# mypy (about a minute of one core) runs beside pytest, which leaves a core idle much of the
# time (engine start-up is mostly single-threaded); its report follows pytest's.
MYPY_LOG="$(mktemp)"
("$VENV/mypy" && "$VENV/mypy" benchmarks) >"$MYPY_LOG" 2>&1 &
MYPY_PID=$!
echo "== pytest (mypy runs beside it)"
PYTEST_STATUS=0
"$VENV/python" -m pytest -q -ra --durations=15 "$@" || PYTEST_STATUS=$?
MYPY_STATUS=0
wait "$MYPY_PID" || MYPY_STATUS=$?
echo "== mypy"; cat "$MYPY_LOG"; rm -f "$MYPY_LOG"
echo "== total: ${SECONDS} s"
if [[ $MYPY_STATUS -ne 0 || $PYTEST_STATUS -ne 0 ]]; then
    echo "== FAILED: mypy exit status $MYPY_STATUS, pytest exit status $PYTEST_STATUS"
    exit 1
fi
