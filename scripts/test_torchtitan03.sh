#!/usr/bin/env bash
# The torchtitan 0.3 tier (tests/torchtitan03): torchtitan 0.3's models under backend="upipe".
# 0.3 goes into its own folder, .torchtitan03, put first on the path of .venv (scripts/setup.sh:
# the pinned torch, upipe-compile and torchtitan 0.2.2 with the rest of 0.3's requirements), so
# the 0.2.2 suite and this tier share one torch. With --prepare only .torchtitan03 is made;
# without --full the tests marked slow are left out, as in scripts/test.sh. Other arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" != "--prepare" ]; then
  bash scripts/setup.sh  # (--prepare comes after it: it must not reinstall .venv under a running suite)
fi
if [ ! -d .torchtitan03/torchtitan ]; then
  # the packages 0.3 needs beyond 0.2.2's (its others are .venv's already)
  .venv/bin/python -m pip install -q --no-deps --target .torchtitan03 "torchtitan==0.3.0" "spmd_types==0.2.3" \
    "torch_checkpointing==0.1.1" "tyro==1.0.17"
fi
if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi
TIER=(-m "not slow")
if [ "${1:-}" = "--full" ]; then
  TIER=()
  shift
fi
export PYTHONPATH="$PWD/.torchtitan03${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -c "import torchtitan, importlib.metadata as m; print('torchtitan', m.version('torchtitan'))"
exec .venv/bin/python -m pytest tests/torchtitan03 -q -p no:cacheprovider --durations=40 "${TIER[@]}" "$@"
