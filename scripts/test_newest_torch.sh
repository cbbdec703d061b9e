#!/usr/bin/env bash
# The fast tier on the newest torch PyPI serves (a second venv, .venv-newest: a CUDA build,
# several GB, that runs on the CPU), beside the suite on the pinned torch
# (scripts/test.sh). With --prepare only the venv is made. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-newest/bin/python ]; then
  "$PYTHON" -m venv .venv-newest
fi
# no pip config: a machine-wide cap on torch's version would pin the old release
export PIP_CONFIG_FILE=/dev/null
.venv-newest/bin/python -m pip install -q --upgrade pip
.venv-newest/bin/python -m pip install -q --no-compile --upgrade torch
.venv-newest/bin/python -m pip install -q --no-compile -e ".[test,torchtitan022]"
if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi
.venv-newest/bin/python -c "import torch; print('newest torch:', torch.__version__)"
exec .venv-newest/bin/python -m pytest tests -q -p no:cacheprovider -m fast "$@"
