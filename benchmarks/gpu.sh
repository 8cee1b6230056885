#!/usr/bin/env bash
# The GPU suites, by target. docs/benchmarks.md says what each figure measures and holds today's figures.
# Usage on a machine with NVIDIA GPUs, from the repository root:
#   bash benchmarks/gpu.sh TARGET [TARGET ...]
# Targets:
#   tests       every test marked gpu (pytest -m gpu tests); the whole log under $OUT
#   parity      exactrl parity --device cuda: qwen3-0.6b exact (long, and with preemption, prefix sharing and forks),
#               the fast-mode control (must fail), tiny-moe exact and its control; on 2+ GPUs also the engine split
#               over two ranks (--nproc 2: tensor parallel on qwen3-0.6b, expert parallel on tiny-moe)
#   price       the price tables: rollout exact / fast at 1-256 sequences (and its plot), the training step against
#               the compiled stock-PyTorch step and transformers (train_vs_torch.py), whole RL steps (bench rl)
#   host        the training step's GPU-busy fraction and exact / fast / stock in three separate processes;
#               BUSY=1 spins one host core beside every run (what a shared host does)
#   plan-check  the memory plan against measured per-phase peaks (benchmarks/plan_check.py: qwen3-0.6b, qwen3-1.7b
#               with and without offload, the README's bench rl, a qwen3-8b full fine-tune; docs/memory.md)
#   multi       2 GPUs: bench rl colocated at world size 2, then 1 generator + 1 trainer at k = 1; decode split
#               over two GPUs (decode_split.py); the qwen3-8b weight send; MULTI_30B=1 adds qwen3-30b-a3b's RL step
# Environment: OUT (logs; default /tmp/exactrl-gpu), BUSY (price and host: busy cores, default 0), PRESETS (price and host:
# default "qwen3-0.6b qwen3-1.7b"), REPEATS (price: train_vs_torch repeats, default 3). Records go to
# benchmarks/results/ (exactrl bench's own names); compare a new one with bench_check.py.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 NCCL_NVLS_ENABLE=0 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/exactrl-gpu}
X="python3 -m exactrl.cli"
PRESETS=${PRESETS:-qwen3-0.6b qwen3-1.7b}
[[ $# -gt 0 ]] || { sed -n '2,21p' "$0"; exit 2; }
NGPU=$(nvidia-smi --list-gpus | wc -l)
mkdir -p "$OUT" benchmarks/results
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
log() { { grep -v -i warn || true; } | tee -a "$OUT/$1"; }  # the output without warnings, appended to $OUT/FILE
rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
  --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
  --tokens-per-microbatch 4096"  # the bench rl shape of docs/benchmarks.md
for target in "$@"; do
  case $target in
  tests)
    timeout 590 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -30 ;;
  parity)
    $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 24 --max-tokens 288 --json 2>&1 | log parity.txt
    $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 128 --samples-per-prompt 4 \
      --kv-blocks 96 --prefill-chunk 32 --temperature 0.7 --json 2>&1 | log parity.txt
    $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --mode fast --num-prompts 8 --max-tokens 64 --json 2>&1 \
      | log parity.txt  # the control: must report mismatches
    for mode in exact fast; do
      $X parity --preset tiny-moe --device cuda --dtype bfloat16 --mode $mode --num-prompts 16 --max-tokens 128 --json 2>&1 \
        | log parity.txt
    done
    if ((NGPU >= 2)); then
      $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 128 --nproc 2 \
        --tensor-parallel 2 --json 2>&1 | log parity.txt
      $X parity --preset tiny-moe --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 64 --nproc 2 \
        --expert-parallel 2 --json 2>&1 | log parity.txt
    fi ;;
  price)
    for c in 1 4 16 64 256; do
      for mode in exact fast; do
        $X bench rollout --preset qwen3-0.6b --mode $mode --device cuda --concurrency $c --prompt-len 128 \
          --max-tokens 256 --json 2>>"$OUT/price.log" | grep '^{' | tee -a "$OUT/price-rollout.jsonl"
      done
    done
    python3 benchmarks/plot_price.py "$OUT/price-rollout.jsonl" --png "$OUT/price-rollout.png" | tee -a "$OUT/price.txt"
    for P in $PRESETS; do
      python3 benchmarks/train_vs_torch.py --preset $P --repeats ${REPEATS:-3} --steps 10 --busy-cores ${BUSY:-0} 2>&1 \
        | grep -E '^(repeat|step|exact|fast|stock|hf|qwen|\{)|Error|error:' | tee -a "$OUT/train-vs-torch.txt"
    done
    for mode in exact fast; do $X bench rl $rl --mode $mode 2>&1 | log bench-rl.txt; done ;;
  host)
    for P in $PRESETS; do
      python3 benchmarks/probe_host_side.py --preset $P --busy-cores ${BUSY:-0} 2>&1 | grep '^{' | tee -a "$OUT/host-busy.jsonl"
      for proc in 1 2 3; do
        python3 benchmarks/train_vs_torch.py --preset $P --which exact fast stock --repeats 1 --steps 10 \
          --busy-cores ${BUSY:-0} 2>&1 | grep -E '^\{|Error' | tee -a "$OUT/host-table.jsonl"
      done
    done ;;
  plan-check)
    base="--set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0 --set train.steps=2
      --set algorithm.rollouts_per_step=128 --set task.num_eval=16 --set task.eval_every=0 --set run.progress=false
      --set engine.max_model_len=1024 --set sampling.max_tokens=512 --set train.save_at_end=false"
    for run in "qwen3-0.6b none" "qwen3-1.7b none" "qwen3-1.7b optimizer"; do set -- $run
      python3 benchmarks/plan_check.py configs/quickstart.toml $base --set model.preset=$1 --set train.offload=$2 \
        --out-dir "$OUT/plan-$1-$2" 2>&1 | log plan-check.txt
    done
    python3 benchmarks/plan_check.py --bench-rl -- --warmup 1 --steps 1 2>&1 | log plan-check.txt  # README's bench rl
    python3 benchmarks/plan_check.py configs/quickstart.toml $base --set model.preset=qwen3-8b --set train.offload=optimizer \
      --set train.activation_checkpointing=true --out-dir "$OUT/plan-8b" 2>&1 | log plan-check.txt ;;
  multi)
    ((NGPU >= 2)) || { echo "multi: needs 2 GPUs, this machine has $NGPU" >&2; exit 1; }
    $X bench rl $rl --mode exact --nproc 2 --out-dir "$OUT/rl-colocated" 2>&1 | log multi.txt
    $X bench rl $rl --mode exact --nproc 2 --generator-ranks 1 --max-off-policy-steps 1 \
      --baseline "$(ls "$OUT"/rl-colocated/*.json 2>/dev/null | head -1)" --out-dir "$OUT/rl-gen1-k1" 2>&1 | log multi.txt
    python3 benchmarks/decode_split.py --preset qwen3-8b --max-tokens 128 2>&1 | log multi.txt
    torchrun --standalone --nproc-per-node 2 benchmarks/decode_split.py --preset qwen3-8b --max-tokens 128 2>&1 \
      | log multi.txt
    $X bench rl --preset qwen3-8b --mode exact --nproc 2 --generator-ranks 1 --prompts 8 --samples 2 --max-tokens 64 \
      --prompt-max 128 --tokens-per-microbatch 4096 --warmup 1 --steps 2 --set model.init_draws=keyed \
      --set train.offload=optimizer --out-dir "$OUT/rl-8b-send" 2>&1 | log multi.txt
    if [[ -n "${MULTI_30B:-}" ]]; then
      $X bench rl --preset qwen3-30b-a3b --mode exact --nproc 2 --prompts 16 --samples 4 --max-tokens 256 \
        --prompt-max 256 --tokens-per-microbatch 4096 --kv-memory-fraction 0.5 --warmup 1 --steps 2 \
        --set train.offload=optimizer --set train.activation_checkpointing=true --set engine.expert_parallel=2 \
        --set model.init_draws=keyed --set train.fsdp_reduce=microbatch --out-dir "$OUT/rl-30b" 2>&1 | log multi.txt
    fi ;;
  *) echo "gpu.sh: unknown target '$target' (tests, parity, price, host, plan-check, multi)" >&2; exit 2 ;;
  esac
done
