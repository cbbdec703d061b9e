#!/usr/bin/env bash
# One rank of the 8-node Llama-3.1-70B job on one GPU, within its own deadline (default 300 s):
#   bash scripts/gpu_70b_rank.sh OUT_DIR [DEADLINE_S]
# benchmarks/gpu_rank.py --job 70b: rank 0 of the shipped TOML's 64 ranks (UPipe 8 x ring 8,
# the long-context stack; fake process group for the others) with its first 1 and 2 of 80
# layers at 1M and 2M tokens (a layer at the TOML's 11M takes minutes a step on one GPU),
# UPipe (U = 8) beside Ulysses (U = 64): the step time, max_memory_allocated against the
# estimate of the same step, and what was live at the peak; what the deadline stops is listed
# as not measured.
# Run after scripts/gpu_flagship.sh (the device ratio it measures is the 8B job's).
set -u
out=${1:?usage: bash scripts/gpu_70b_rank.sh OUT_DIR [DEADLINE_S]}
deadline=${2:-300}
mkdir -p "$out"
py=${PYTHON:-python3}
source "$(dirname "$0")/device_env.sh" || { echo "device_env.sh failed" >&2; exit 1; }
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
start=$SECONDS
device=$($py -c "import torch; p = torch.cuda.get_device_properties(0); print(f'{p.name} ({p.total_memory >> 20} MiB), torch {torch.__version__}')")
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
echo "# device: $device; code at commit $commit" > "$out/gpu_rank_70b.md"
failed=0
$py benchmarks/gpu_rank.py --job 70b --layers 1 2 --seqs 1048576 2097152 --timeout $(( deadline - 15 )) \
    --out "$out/gpu_rank_70b.body.md" || failed=1
cat "$out/gpu_rank_70b.body.md" >> "$out/gpu_rank_70b.md" 2>/dev/null && rm -f "$out/gpu_rank_70b.body.md"
echo "# $((SECONDS - start)) s"
exit $failed
