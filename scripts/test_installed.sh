#!/usr/bin/env bash
# The installed-package tier: build the wheel as a user's pip does, install it (not editable)
# into a clean venv (.venv-installed: the pinned torch and the `hf` extra, no torchtitan), and
# run tests/installed/check_installed.py from a folder outside the checkout; then add the
# `torchtitan` extra (0.3) to that venv and run the checks that need it. The venv is reused
# between runs; the package in it is always the wheel just built. With --prepare only the venv and
# its torch are made. Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$CHECKOUT/.venv-installed
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --no-compile "torch==2.13.0"
if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi
# a stale install of the package, or a torchtitan from the last run's second phase, must not
# stand in for what this run installs
"$VENV/bin/python" -m pip uninstall -q -y upipe-compile torchtitan >/dev/null 2>&1 || true

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# built as pip builds it for a user: in an isolated build environment, from the files a fresh
# clone has (an in-tree build would reuse build/, which keeps files the tree no longer has)
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$WORK/src"
"$VENV/bin/python" -m pip wheel -q --no-deps "$WORK/src" -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/upipe_compile-*.whl)
"$VENV/bin/python" -m pip install -q --no-compile "$WHEEL[hf]" pytest

# run from outside the checkout, so nothing but the installed package can be imported
mkdir "$WORK/run"
cp tests/installed/*.py "$WORK/run/"
cd "$WORK/run"
export UPIPE_CHECKOUT=$CHECKOUT
"$VENV/bin/python" -m pytest check_installed.py -q -p no:cacheprovider -k "not torchtitan_config" "$@"

"$VENV/bin/python" -m pip install -q --no-compile "$WHEEL[hf,torchtitan]"
UPIPE_INSTALLED_PHASE=torchtitan "$VENV/bin/python" -m pytest check_installed.py -q -p no:cacheprovider \
  -k "wheel_is_what_runs or every_module or torchtitan_config" "$@"
