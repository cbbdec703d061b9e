#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite (what CI runs: every test not marked slow),
# with --full every test (the slow tier too: the 70B estimates and the larger twins of CI's
# tests, listed in tests/conftest.py), or with --fast only
# the fast tier (graph passes, refusals, kernels, small numerics: about 2 minutes on 2 cores;
# the list is in tests/conftest.py). Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TIER=(-m "not slow")
case "${1:-}" in
  --fast) TIER=(-m fast); shift ;;
  --full) TIER=(); shift ;;
esac
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider --durations=60 "${TIER[@]}" "$@"
