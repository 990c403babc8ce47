#!/usr/bin/env bash
# Issue 18 on a machine with two GPUs (nvidia-h200-x2; NVLink multicast off): the data of the three workloads and the
# kernels they run (head dim 64: causal, varlen, dropout) prepared in parallel, then benchmarks/multiprocess_gpu.py:
#   gpt2   GPT-2 small at 4K, global batch 16: one GPU (twice: the noise), DDP and FSDP on 2 GPUs, 50 steps; the
#          checkpoint at step 25 continued 2 -> 1 (DDP, FSDP) and 1 -> 2 (DDP)
#   bert   BERT-large MLM (unpadded varlen), global batch 32: one GPU (twice) and DDP on 2, dropout off, then with
#          the recipe's dropout (0.1) on one GPU and DDP, 20 steps
#   listops  the listops recipe, the same five runs
# Results (JSON + PNG) in $OUT, every log in $OUT/logs.tgz.
#   PARTS="gpt2 bert listops" bash benchmarks/probes/issue18_gpu.sh [OUT]
#   PARTS=gpt2 PART_RUNS="plain fsdp-2 fsdp-2-gc" MP_ARGS="--name gpt2-4k-fsdp" bash ...   (other runs, other files)
#   ... MP_ARGS="--extra trainer.profile_steps=30-31" ...   (each process's trace of steps 30-31 in logs.tgz, and
#          benchmarks/probes/trace_gaps.py's summary of where each GPU waited in $OUT/trace_gaps.txt / .json)
#   RUNS_gpt2="plain ddp-2" RUNS_listops="plain-nodrop ddp-2-nodrop" ...   (runs of one part; PART_RUNS: of every part;
#          MP_ARGS_gpt2=... likewise for MP_ARGS)
set -uo pipefail
source "$(dirname "$0")/steps.sh"
probe_setup /tmp/issue18 "${1:-}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHTRAIN_KERNEL_CACHE=/tmp/issue18/kernel-cache
RESULTS=$OUT; OUT=/tmp/issue18/logs; mkdir -p "$OUT"  # step logs here, tarred into the results at the end
PARTS=${PARTS:-gpt2 bert listops}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$RESULTS/gpu.txt"
python -c "import torch; print('torch', torch.__version__)" | tee -a "$RESULTS/gpu.txt"
date -u +%FT%TZ | tee -a "$RESULTS/gpu.txt"
MP=(python benchmarks/multiprocess_gpu.py --out "$RESULTS" --runs-dir /tmp/issue18/runs
    --cache-dir /tmp/issue18/cache --tokenizer "$PWD/.whl/wordpiece")
declare -A WORKLOAD=([gpt2]=gpt2-4k [bert]=bert-large-mlm [listops]=listops)
declare -A RUNS=(
  [gpt2]="plain plain-again ddp-2 fsdp-2 ddp2-on-1 plain-on-ddp2 fsdp2-on-fsdp1"
  [bert]="plain-nodrop plain-again-nodrop ddp-2-nodrop plain ddp-2"
  [listops]="plain-nodrop plain-again-nodrop ddp-2-nodrop plain ddp-2"
)

for part in $PARTS; do
  "${MP[@]}" --workload "${WORKLOAD[$part]}" --prepare > "$OUT/prepare_$part.log" 2>&1 &
done
step build python -m flashtrain.kernels.build -j 16 \
  --only '^(flash_aux_bf16|ft_cross_entropy_(bf16|fp32)|flash_(fwd|bwd)_sm90_hdim64_bf16(_causal)?(_dropout)?(_192x128)?)$'
wait
for part in $PARTS; do tail -n 2 "$OUT/prepare_$part.log"; done
for part in $PARTS; do
  # shellcheck disable=SC2086
  runs_of_part="RUNS_$part" args_of_part="MP_ARGS_$part"
  step "$part" timeout 480 "${MP[@]}" --workload "${WORKLOAD[$part]}" --runs ${!runs_of_part:-${PART_RUNS:-${RUNS[$part]}}} ${!args_of_part:-${MP_ARGS:-}}
done
traces=$(find /tmp/issue18/runs -path '*/profile/*.json' | sort)
if [ -n "$traces" ]; then
  # shellcheck disable=SC2086
  step trace_gaps python benchmarks/probes/trace_gaps.py $traces --json "$RESULTS/trace_gaps.json"
  cp "$OUT/trace_gaps.log" "$RESULTS/trace_gaps.txt"; cat "$RESULTS/trace_gaps.txt"
fi
(cd /tmp/issue18 && tar czf "$RESULTS/logs.tgz" logs $(find runs -maxdepth 4 \( -name '*.log' -o -name metrics.jsonl -o -path '*/profile/*.json' \)))
exit $status
