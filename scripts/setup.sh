#!/usr/bin/env bash
# Create .venv with the pinned CPU torch and upipe-compile (editable) plus its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned here only (pyproject admits >= 2.11, e.g. the CUDA 2.11 on GPU nodes).
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,torchtitan022,bench]"
