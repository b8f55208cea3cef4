#!/usr/bin/env bash
# Fill .whl-infinity/ (in the repo you run this from) with Infinity (infinity-emb 0.0.78, the peer server of
# `python -m bench serve peer`) and the packages of its server that it pins apart from ours (uvicorn < 0.33, typer,
# click, rich and theirs) or that the GPU image lacks; by default for CPython 3.12 x86-64 (the GPU image).
# Not fetched: what the image already has (torch, transformers, sentence-transformers, numpy, tokenizers,
# huggingface_hub), fastapi/starlette/pydantic (the server's .whl/ brings them, see docs/development.md),
# and posthog (Infinity's anonymous usage statistics: without it they are off whatever the environment says).
# Usage: bash bench/peer-wheels.sh [--python-version 3.11]   (3.11 for a test on this machine's venv)
# Then carry ".whl-infinity" in the device run and install it with the line this script prints.
set -euo pipefail
python_version=3.12
if [[ ${1:-} == --python-version ]]; then python_version=${2:?--python-version X.Y}; fi
top=$(git rev-parse --show-toplevel)
cd "$top"
grep -qxF '/.whl-infinity/' .git/info/exclude 2>/dev/null || echo '/.whl-infinity/' >> .git/info/exclude
rm -rf .whl-infinity  # one Python version's wheels at a time: the install takes every wheel in the folder
mkdir -p .whl-infinity
# --no-deps with every distribution named: Infinity's own requirements would pull numpy < 2 and
# sentence-transformers < 4 over the image's, which its torch engine runs on (with bench/peer_launch.py's shim)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl-infinity \
  "infinity-emb==0.0.78" "uvicorn>=0.32,<0.33" "typer>=0.12.5,<0.13" "click>=8.0,<8.2" "rich>=13,<14" \
  "markdown-it-py<4" mdurl pygments shellingham httptools uvloop orjson prometheus-client \
  "prometheus-fastapi-instrumentator>=6.1" 2>&1 | grep -v '^WARNING: Location' || true
du -sh .whl-infinity | sed 's/^/wheels: /'
echo 'Install on the device (after the .whl/ line) with:'
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/infinity-site .whl-infinity/*.whl'
