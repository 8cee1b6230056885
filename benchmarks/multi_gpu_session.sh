#!/usr/bin/env bash
# One bundled multi-GPU session (2 GPUs of one host, NCCL): parity at world size 2 with the fast-mode control, a
# GRPO run on qwen3-1.7b at world sizes 2 and 1 (step time split into generate / train / weight sync), and a
# qwen3-8b-shaped full fine-tune at world size 2 (its fp32 masters + AdamW state do not fit one GPU).
# Usage on the machine (repo root): PYTHONPATH=. OUT=/some/dir bash benchmarks/multi_gpu_session.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=${PYTHONPATH:-.} NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/exactrl-multi-gpu}
mkdir -p "$OUT"
X="python3 -m exactrl.cli"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.txt"
# 1. parity, 2 ranks: each rank's engine against the FSDP-sharded trainer's forward
timeout 150 $X parity --nproc 2 --preset qwen3-1.7b --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 128 \
  --json 2>&1 | grep -v Warning | tail -4 | tee "$OUT/parity.txt"
timeout 90 $X parity --nproc 2 --preset qwen3-1.7b --device cuda --dtype bfloat16 --mode fast --num-prompts 8 \
  --max-tokens 64 --json 2>&1 | grep -v Warning | tail -4 | tee -a "$OUT/parity.txt"
# 2. GRPO on qwen3-1.7b, 3 steps, world sizes 2 and 1 (the same global batch)
base="--set model.preset=qwen3-1.7b --set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0
  --set train.steps=3 --set algorithm.rollouts_per_step=256 --set task.num_eval=8 --set task.eval_every=0
  --set run.progress=false --set engine.max_model_len=512 --set sampling.max_tokens=256 --set train.save_every=0 --set train.save_at_end=false"
for n in 2 1; do
  timeout 150 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/grpo-ws$n --nproc $n 2>&1 \
    | grep -E "^step|differ|Error" | tee -a "$OUT/grpo.txt"
  python3 -c "import json; rows=[json.loads(l) for l in open('$OUT/grpo-ws$n/metrics.jsonl') if '\"loss\"' in l]
print('ws$n', json.dumps([{k: r.get(k) for k in ('step','mismatch/num_tokens','mismatch/num_mismatched_tokens','perf/step_s','perf/generate_s','perf/train_s','time/weight_sync_s','weight_sync/bytes','perf/gpu_memory_peak_gb','grad_norm','loss')} for r in rows]))" \
    | tee -a "$OUT/grpo.txt"
done
# 3. qwen3-8b shape, full fine-tune, world size 2
timeout 280 $X train configs/quickstart.toml --set model.preset=qwen3-8b --set model.dtype=bfloat16 \
  --set run.device=cuda --set sft.steps=0 --set train.steps=2 --set algorithm.rollouts_per_step=32 \
  --set sampling.max_tokens=64 --set engine.max_model_len=256 --set task.num_eval=4 --set task.eval_every=0 \
  --set run.progress=false --set train.save_every=0 --set train.save_at_end=false \
  --set run.output_dir=$OUT/grpo-8b-ws2 --nproc 2 2>&1 | grep -E "^step|differ|Error|memory" | tee "$OUT/grpo_8b.txt"
python3 -c "import json; rows=[json.loads(l) for l in open('$OUT/grpo-8b-ws2/metrics.jsonl') if '\"loss\"' in l]
print(json.dumps([{k: r.get(k) for k in ('step','mismatch/num_tokens','mismatch/num_mismatched_tokens','perf/step_s','perf/train_s','time/weight_sync_s','perf/gpu_memory_peak_gb')} for r in rows]))" \
  | tee -a "$OUT/grpo_8b.txt"
