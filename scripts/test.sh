#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite (what CI runs), or with --fast only
# the fast tier (graph passes, refusals, kernels, small numerics: about 2 minutes on 2 cores;
# the list is in tests/conftest.py). Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TIER=()
if [ "${1:-}" = "--fast" ]; then
  TIER=(-m fast)
  shift
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=30 "${TIER[@]}" "$@"
