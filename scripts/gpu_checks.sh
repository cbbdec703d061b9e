#!/usr/bin/env bash
# The checks to run first on a GPU node, in one command (at most 9 minutes on one H100/H200):
#   bash scripts/gpu_checks.sh OUT_DIR
# 1. benchmarks/kernel_check.py   the device's attention kernels against SDPA's fp32 math
# 2. benchmarks/gpu_check.py      CUDA path, stage-loop memory against the model, offload, packed
# 3. benchmarks/hybrid_smoke.py   every routed hybrid family compiles and runs on the device
# 4. the model tests (hybrids, MLA and families, own attention, Trainer) on this machine's torch
# Each writes its own file in OUT_DIR; a failing step does not stop the others; the exit
# status is non-zero when any failed.
set -u
out=${1:?usage: bash scripts/gpu_checks.sh OUT_DIR}
mkdir -p "$out"
py=${PYTHON:-python3}
source "$(dirname "$0")/device_env.sh" || { echo "device_env.sh failed" >&2; exit 1; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
failed=0
device=$($py -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name} ({p.total_memory >> 20} MiB), torch {torch.__version__}')")
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)

step() {  # step NAME COMMAND...: run COMMAND, its output to OUT_DIR/NAME with a header
    local name=$1; shift
    { echo "# device: $device; tests and code at commit $commit"; echo "# command: $*"; } > "$out/$name"
    local start=$SECONDS
    "$@" >> "$out/$name" 2>&1 || { failed=1; echo "# FAILED" >> "$out/$name"; }
    echo "# $((SECONDS - start)) s" >> "$out/$name"
    echo "$name: $(tail -n 3 "$out/$name" | tr '\n' ' ')"
}

step kernel_check.txt $py benchmarks/kernel_check.py
step gpu_check.md $py benchmarks/gpu_check.py
step hybrid_smoke.txt $py benchmarks/hybrid_smoke.py
workers=$(( $(nproc) / 4 > 1 ? $(nproc) / 4 : 1 ))
step model_tests.txt timeout 180 $py -m pytest -q -p no:cacheprovider -n "$workers" -k "not sft" \
    tests/test_hf_hybrid_numerics.py tests/test_hf_hybrids.py tests/test_hf_own_attention.py \
    tests/test_hf_trainer.py tests/test_mixer_loop.py tests/test_token_mixing.py
step mla_tests.txt timeout 60 $py -m pytest -q -p no:cacheprovider -n "$workers" -k "deepseek or mla" \
    tests/test_hf_families.py
exit $failed
