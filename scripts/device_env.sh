#!/usr/bin/env bash
# Sourced by the GPU scripts (gpu_flagship.sh, gpu_checks.sh) on a machine without a package
# index: installs the wheels carried in .whl/ (scripts/device_wheels.sh made them) and this
# checkout itself into /tmp/upipe-site, and puts that first on PYTHONPATH. The package is
# installed, not run from the checkout: a bare checkout does not join passes/ and
# integrations/torchtitan/ into upipe_compile (setup.py does). Without .whl/ it installs only
# the package (an image that has torchtitan already).
#   source scripts/device_env.sh
DEVICE_SITE=${DEVICE_SITE:-/tmp/upipe-site}
_py=${PYTHON:-python3}
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_install() { "$_py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$DEVICE_SITE" "$@"; }
if ls "$_root"/.whl/*.whl >/dev/null 2>&1; then
    _install --upgrade "$_root"/.whl/*.whl || return 1
    # datasets needs pyarrow >= 24; the image's is used when it is new enough
    if ! "$_py" -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null \
        && ls "$_root"/.whl/pyarrow/*.whl >/dev/null 2>&1; then
        _install "$_root"/.whl/pyarrow/*.whl || return 1
    fi
fi
_install --no-build-isolation "$_root" || return 1
export PYTHONPATH="$DEVICE_SITE${PYTHONPATH:+:$PYTHONPATH}"
"$_py" -c "import torchtitan" 2>/dev/null \
    || echo "device_env: torchtitan is not importable (carry .whl: bash scripts/device_wheels.sh)" >&2
