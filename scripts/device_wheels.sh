#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index (Python 3.12, x86-64): torchtitan
# 0.2.2 and what it imports beyond a CUDA torch image (torchdata, datasets with dill and
# multiprocess, tyro with docstring-parser and typeguard), into .whl/ (git-ignored); a pyarrow
# wheel into .whl/pyarrow/ for an image whose pyarrow is older than datasets needs (24).
# Run it here, with network; carry .whl to the machine; scripts/device_env.sh installs them there.
#   bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
download() {  # download DEST REQUIREMENT...
    local dest=$1; shift
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$dest" "$@"
}
download .whl "torchtitan==0.2.2" "torchdata==0.11.0" "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" \
    "tyro==1.0.17" "docstring-parser==0.18.0" "typeguard==4.6.1"
download .whl/pyarrow "pyarrow>=24"
du -sh .whl
