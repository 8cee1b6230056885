#!/usr/bin/env bash
# One bundled multi-GPU session (GPUs of one host, NCCL, NVLink multicast off). Sections:
#   parity    parity at world size 2 with the fast-mode control                                     (2 GPUs)
#   grpo      a GRPO run on qwen3-1.7b at world sizes 2 and 1 (generate / train / weight sync)      (2 GPUs)
#   8b        a qwen3-8b-shaped full fine-tune at world size 2 (fp32 masters + AdamW exceed one GPU) (2 GPUs)
#   bench     `bench train --fsdp` and `bench rollout` on qwen3-1.7b at world sizes 1 and 2, side by side (2 GPUs)
#   bench-ws4 the same at world sizes 1, 2 and 4                                                    (4 GPUs)
# Usage on the machine (repo root): PYTHONPATH=. OUT=/some/dir bash benchmarks/multi_gpu_session.sh [SECTION ...]
# (no section: parity grpo 8b bench, the 2-GPU session).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/exactrl-multi-gpu}
mkdir -p "$OUT" benchmarks/results
X="python3 -m exactrl.cli"
SECTIONS=" ${*:-parity grpo 8b bench} "
want() { [[ "$SECTIONS" == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
if want parity; then  # 1. parity, 2 ranks: each rank's engine against the FSDP-sharded trainer's forward
timeout 150 $X parity --nproc 2 --preset qwen3-1.7b --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 128 \
  --json 2>&1 | grep -v Warning | tail -4 | tee "$OUT/parity.txt"
timeout 90 $X parity --nproc 2 --preset qwen3-1.7b --device cuda --dtype bfloat16 --mode fast --num-prompts 8 \
  --max-tokens 64 --json 2>&1 | grep -v Warning | tail -4 | tee -a "$OUT/parity.txt"
fi
if want grpo; then  # 2. GRPO on qwen3-1.7b, 3 steps, world sizes 2 and 1 (the same global batch)
base="--set model.preset=qwen3-1.7b --set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0
  --set train.steps=3 --set algorithm.rollouts_per_step=256 --set task.num_eval=8 --set task.eval_every=0
  --set run.progress=false --set engine.max_model_len=512 --set sampling.max_tokens=256 --set train.save_every=0 --set train.save_at_end=false"
for n in 2 1; do
  timeout 150 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/grpo-ws$n --nproc $n 2>&1 \
    | grep -E "^step|differ|Error" | tee -a "$OUT/grpo.txt"
  python3 -c "import json; rows=[json.loads(l) for l in open('$OUT/grpo-ws$n/metrics.jsonl') if '\"loss\"' in l]
print('ws$n', json.dumps([{k: r.get(k) for k in ('step','mismatch/num_tokens','mismatch/num_mismatched_tokens','perf/step_s','perf/generate_s','perf/train_s','time/weight_sync_s','weight_sync/bytes','perf/gpu_memory_peak_gb','perf/gpu_memory_peak_gb/rank0','perf/gpu_memory_peak_gb/rank1','grad_norm','loss')} for r in rows]))" \
    | tee -a "$OUT/grpo.txt"
done
fi
if want 8b; then  # 3. qwen3-8b shape, full fine-tune, world size 2
timeout 280 $X train configs/quickstart.toml --set model.preset=qwen3-8b --set model.dtype=bfloat16 \
  --set run.device=cuda --set sft.steps=0 --set train.steps=2 --set algorithm.rollouts_per_step=32 \
  --set sampling.max_tokens=64 --set engine.max_model_len=256 --set task.num_eval=4 --set task.eval_every=0 \
  --set run.progress=false --set train.save_every=0 --set train.save_at_end=false \
  --set run.output_dir=$OUT/grpo-8b-ws2 --nproc 2 2>&1 | grep -E "^step|differ|Error|memory" | tee "$OUT/grpo_8b.txt"
python3 -c "import json; rows=[json.loads(l) for l in open('$OUT/grpo-8b-ws2/metrics.jsonl') if '\"loss\"' in l]
print(json.dumps([{k: r.get(k) for k in ('step','mismatch/num_tokens','mismatch/num_mismatched_tokens','perf/step_s','perf/train_s','time/weight_sync_s','perf/gpu_memory_peak_gb','perf/gpu_memory_peak_gb/rank0','perf/gpu_memory_peak_gb/rank1')} for r in rows]))" \
  | tee -a "$OUT/grpo_8b.txt"
fi
# 4. `bench train --fsdp` and `bench rollout` at several world sizes, side by side (qwen3-1.7b, bf16, exact).
# train: each rank trains 8 x 1024 tokens of its own (the global batch grows with the ranks, as the RL loop's
# microbatches per rank do); rollout: 256 requests of 128 + 256 tokens in all, split over the ranks (the global
# batch is fixed, as in the RL loop). World size 1 runs first; the others take its JSON as --baseline (scaling
# efficiency). Each JSON holds every rank's tok/s, step or wall time, MFU and peak memory. About 1-2 min a line.
bench_at() {
  local n=$1 bt="" br=""
  if [ "$n" -gt 1 ]; then
    bt="--baseline benchmarks/results/train-qwen3-1.7b-fsdp-exact-$DEV.json"
    br="--baseline benchmarks/results/rollout-qwen3-1.7b-c256-exact-$DEV.json"
  fi
  timeout 420 $X bench train --fsdp --nproc "$n" --preset qwen3-1.7b --device cuda --dtype bfloat16 \
    --tokens-per-microbatch 8192 --steps 5 $bt 2>&1 | grep -v Warning | tail -14 | tee -a "$OUT/bench_train.txt"
  timeout 300 $X bench rollout --nproc "$n" --preset qwen3-1.7b --device cuda --dtype bfloat16 --concurrency 256 \
    --prompt-len 128 --max-tokens 256 $br 2>&1 | grep -v Warning | tail -14 | tee -a "$OUT/bench_rollout.txt"
}
bench_table() {  # the records of these world sizes as one Markdown table
  local files=""
  for n in "$@"; do
    local w=""; [ "$n" -gt 1 ] && w="-ws$n"
    files+=" benchmarks/results/train-qwen3-1.7b-fsdp$w-exact-$DEV.json benchmarks/results/rollout-qwen3-1.7b-c256$w-exact-$DEV.json"
  done
  local tag="$*"
  python3 benchmarks/scaling_table.py $files | tee "$OUT/bench_table_ws${tag// /-}.md"
}
if want bench || want bench-ws4; then
  DEV=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
fi
if want bench; then
  bench_at 1; bench_at 2; bench_table 1 2
fi
if want bench-ws4; then  # on a 4-GPU machine: world sizes 1, 2 and 4 in one session
  bench_at 1; bench_at 2; bench_at 4; bench_table 1 2 4
fi
