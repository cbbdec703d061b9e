#!/usr/bin/env bash
# The flagship job on one GPU, in one command, within its own deadline (default 450 s):
#   bash scripts/gpu_flagship.sh OUT_DIR [DEADLINE_S]
# 1. benchmarks/hopper_speed.py: one rank's stage loop at 1M tokens (Llama3-8B, U = P = 8) on
#    each installed CUDA attention kernel against aten's flash kernel (a tenth of the time).
# 2. benchmarks/gpu_rank.py: one rank of the 8-GPU Llama3-8B job (the 5M TOML, fake process
#    group for the other ranks) at 1 and 2 layers, 1M and 2M tokens, for UPipe, UPipe +
#    keep_attention and Ulysses, then UPipe alone at 5,242,880 while time is left: per job the
#    step time and MFU, max_memory_allocated against the estimate of the same step, and what
#    was live at the device's peak (the allocator's history) beside the estimate's breakdown.
# Rows are written as they are measured; what the deadline stops is listed as not measured.
# Run scripts/gpu_checks.sh first (the kernels' correctness on this device).
set -u
out=${1:?usage: bash scripts/gpu_flagship.sh OUT_DIR [DEADLINE_S]}
deadline=${2:-450}
mkdir -p "$out"
py=${PYTHON:-python3}
source "$(dirname "$0")/device_env.sh" || { echo "device_env.sh failed" >&2; exit 1; }
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
start=$SECONDS
device=$($py -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name} ({p.total_memory >> 20} MiB), torch {torch.__version__}')")
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "# device: $device; code at commit $commit" | tee "$out/hopper_speed.md" > "$out/gpu_rank_flagship.md"
failed=0
$py benchmarks/hopper_speed.py --deadline $(( deadline / 10 )) --out "$out/hopper_speed.md" || failed=1
left=$(( deadline - (SECONDS - start) - 15 ))
$py benchmarks/gpu_rank.py --layers 1 2 --seqs 1048576 2097152 --upipe-alone-seqs 5242880 --timeout "$left" \
    --out "$out/gpu_rank_flagship.body.md" || failed=1
cat "$out/gpu_rank_flagship.body.md" >> "$out/gpu_rank_flagship.md" 2>/dev/null && rm -f "$out/gpu_rank_flagship.body.md"
echo "# $((SECONDS - start)) s"
exit $failed
