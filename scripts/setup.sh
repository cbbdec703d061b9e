#!/usr/bin/env bash
# Create .venv with the pinned CPU torch and upipe-compile (editable) plus its test extras.
# Skipped when .venv was set up from this very pyproject.toml, setup.py and script (a stamp in
# .venv): a second run changes nothing, and the CI's other tiers may be installing beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.upipe-setup
WANTED=$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANTED" ]; then
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned here only (pyproject admits >= 2.11, e.g. the CUDA 2.11 on GPU nodes).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,torchtitan022,bench]"
echo "$WANTED" >"$STAMP"
