#!/usr/bin/env bash
# One bundled GPU session: tests marked gpu, end-to-end parity on qwen3-0.6b, rollout and train benchmarks.
# Usage on the GPU machine (repo root):
#   PYTHONPATH=. bash benchmarks/gpu_session.sh [tests] [parity] [rollout] [train] [kernels] [matmul-configs]
#     [attention-configs] [attention-fwd-configs] [profile] [tests-engine] [rollout-256] [rollout-1]
#     [tests-all] [parity-llama] [guard] [fsdp] [rl-gpu] [hf-parity] [lora-8b] [exact-tests] [fast-tests] [probe-gemm]
#     [price] [price-rollout] [price-train] [bench-rl] [multi-turn-parity] [profile-gen]
#     [bench-rl-profile] [tail-check] [bench-rl-exact] [probe-train] [probe-decode] [split-check] [split-ab] [bench-rl-nosplit] [split-wide]
#     [moe-tests] [moe-probe] [moe-parity] [moe-price] [moe-train-price] [moe-sweep] [moe-rl] [plan-check] [bench-rl-offpolicy]
#     [probes-overlap] [fsdp-mb] [bench-rl-overlap] [bench-rl-partial] [kv-sweep] [pin-8b] [offload-cost] [plan-trace] [train-eager] [fsdp-offload] [train-vs-torch]
#     [parity-split] [rl-30b] [weight-send-8b] [load-8b] [decode-split] [host-table] [profile-vs-torch] [train-table] [probe-adamw] [fsdp-ws2] [bench-rl-2gpu] (fsdp-offload: NPROC=2 for two GPUs)
#     [pdl-ab] [ab-rollout] [ab-train] [profile-decode] [probe-mid-bk] (AB_BASE: a folder holding a baseline exactrl package) [probe-chunked-gemm] [probe-l2] [step-times]
# ("all" = tests parity rollout train kernels).
# Results: benchmarks/results/*.json, and logs under $OUT when set.
set -uo pipefail
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=${PYTHONPATH:-.}
OUT=${OUT:-/tmp/exactrl-gpu}
mkdir -p "$OUT" benchmarks/results
X="python3 -m exactrl.cli"
want() { [[ " $SECTIONS " == *" $1 "* ]] || { [[ " $SECTIONS " == *" all "* ]] && [[ " tests parity rollout train kernels " == *" $1 "* ]]; }; }
SECTIONS=" ${*:-all} "
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
if want tests-engine; then  # the engine's GPU tests alone (a subset of "tests")
  timeout 300 python3 -m pytest -q -m gpu tests/engine/test_sampler.py tests/engine/test_decode_graphs.py 2>&1 \
    | tail -8 | tee "$OUT/tests_engine.txt"
fi
if want tests; then
  timeout 420 python3 -m pytest -q -m gpu tests/ops/test_triton_gpu.py tests/ops/test_triton_sampling.py \
    tests/engine/test_sampler.py tests/engine/test_decode_graphs.py tests/train/test_graphs_gpu.py tests/train/test_optim_gpu.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
fi
if want tests-all; then  # every test marked gpu in the tree (the model, algorithm and guard GPU tests included)
  # The whole log under $OUT as it goes (a call cut short still says how far it got; a fresh machine compiles every
  # Triton kernel first: the twentieth session's did not finish in 345 s).
  timeout 540 python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/tests_all.log" | tail -30 \
    | tee "$OUT/tests_all.txt"
fi
if want pdl-ab; then  # decode with programmatic dependent launch on and off, alternating, CS (default "1 256") x REPS
  for rep in $(seq ${REPS:-2}); do
    for c in ${CS:-1 256}; do
      for pdl in 1 0; do
        EXACTRL_PDL=$pdl timeout 300 $X bench rollout --preset qwen3-0.6b --mode ${MODE:-exact} --device cuda \
          --concurrency $c --prompt-len 128 --max-tokens 256 --json 2>>"$OUT/pdl_ab.log" | grep '^{' \
          | sed "s/^{/{\"pdl\": $pdl, \"rep\": $rep, /" | tee -a "$OUT/pdl_ab.jsonl"
      done
    done
  done
fi
if want ab-rollout; then  # decode, this tree against the exactrl package copied into $AB_BASE, alternating (-P: the
  # working directory is not put first on sys.path, so the base arm imports $AB_BASE's package, not this tree's)
  for rep in $(seq ${REPS:-2}); do
    for c in ${CS:-1 256}; do
      for arm in base head; do
        pp=.; [[ $arm == base ]] && pp=${AB_BASE:?AB_BASE: a folder holding the baseline exactrl package}
        PYTHONPATH=$pp timeout 300 python3 -P -m exactrl.cli bench rollout --preset qwen3-0.6b --mode ${MODE:-exact} \
          --device cuda --concurrency $c --prompt-len 128 --max-tokens 256 --json 2>>"$OUT/ab_rollout.log" \
          | grep '^{' | sed "s/^{/{\"arm\": \"$arm\", \"rep\": $rep, /" | tee -a "$OUT/ab_rollout.jsonl"
      done
    done
  done
fi
if want ab-train; then  # exact training steps, this tree against the package in $AB_BASE, alternating (as ab-rollout)
  for rep in $(seq ${REPS:-2}); do
    for P in ${TABLE_PRESETS:-qwen3-0.6b qwen3-1.7b}; do
      for arm in base head; do
        pp=.; [[ $arm == base ]] && pp=${AB_BASE:?AB_BASE: a folder holding the baseline exactrl package}
        PYTHONPATH=$pp timeout 300 python3 -P -m exactrl.cli bench train --preset $P --mode ${MODE:-exact} \
          --device cuda --steps 10 --json 2>>"$OUT/ab_train.log" \
          | grep '^{' | sed "s/^{/{\"arm\": \"$arm\", \"rep\": $rep, /" | tee -a "$OUT/ab_train.jsonl"
      done
    done
  done
fi
if want probe-chunked-gemm; then  # a GEMM reducing K in fixed chunks: split-K for decode with training's bits? (~2 min)
  timeout 400 python3 benchmarks/probe_chunked_gemm.py 2>&1 | grep -v Warning | tee "$OUT/probe_chunked_gemm.txt"
fi
if want probe-l2; then  # one-row GEMMs cold, hot, and with the next weight asked of L2 one kernel ahead (~1 min)
  timeout 300 python3 benchmarks/probe_l2_prefetch.py ${L2_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/probe_l2.txt"
fi
if want step-times; then  # each exact training step's time (qwen3-1.7b), collector on and off, then a profiled step (~2 min)
  for g in on off; do
    timeout 200 python3 benchmarks/probe_step_times.py --preset ${STEP_PRESET:-qwen3-1.7b} --gc $g \
      $([[ $g == off ]] && echo --profile) > "$OUT/step_times_$g.log" 2>&1
    grep '^{' "$OUT/step_times_$g.log" | tee -a "$OUT/step_times.jsonl" || tail -5 "$OUT/step_times_$g.log"
  done
fi
if want parity-llama; then  # the Llama 3 presets through the same decoder, exact, bf16
  timeout 200 $X parity --preset llama3.2-1b --device cuda --dtype bfloat16 --num-prompts 8 --max-tokens 128 \
    --json 2>&1 | tail -4 | tee -a "$OUT/parity_llama.txt"
fi
if want guard; then  # the cost of checking every token when a step makes several updates
  timeout 300 python3 benchmarks/bench_guard.py --preset qwen3-0.6b --device cuda 2>&1 | tail -6 | tee "$OUT/guard.txt"
fi
if want fsdp; then  # the training step under FSDP2 at world size 1 (torchrun, NCCL) vs today's path
  timeout 400 $X bench train --fsdp --preset qwen3-0.6b --device cuda --tokens-per-microbatch 8192 --steps 5 \
    --json 2>&1 | tail -8 | tee "$OUT/fsdp.txt"
fi
if want rl-gpu; then  # short exact RL runs on the GPU: FSDP under torchrun, LoRA, multi-turn episodes
  base="--set model.preset=qwen3-0.6b --set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0
    --set train.steps=3 --set algorithm.rollouts_per_step=128 --set task.num_eval=16 --set task.eval_every=0
    --set run.progress=false --set engine.max_model_len=256 --set sampling.max_tokens=64"
  timeout 300 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/rl-nproc1 --nproc 1 2>&1 \
    | grep -v Warning | tail -6 | tee "$OUT/rl_gpu.txt"
  timeout 300 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/rl-lora --set lora.rank=16 \
    --set algorithm.kl_coef=0.05 2>&1 | tail -5 | tee -a "$OUT/rl_gpu.txt"
  timeout 300 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/rl-guess --set env.name=guess \
    --set env.max_episode_tokens=200 --set sampling.max_tokens=16 2>&1 | tail -5 | tee -a "$OUT/rl_gpu.txt"
  for d in rl-nproc1 rl-lora rl-guess; do
    python3 -c "import json,sys; s=json.load(open('$OUT/$d/summary.json')); print('$d', s['world_size'], s['mismatched_tokens_total'], s['compared_tokens_total'], round(s['minutes'],2))" | tee -a "$OUT/rl_gpu.txt"
  done
fi
if want multi-turn-parity; then  # episodes with tools/games on cuda (bf16, Triton, CUDA graphs): every model token
  # of every turn vs the trainer (torch.equal), preemption and prefix sharing on, the fast control; -s prints counts
  timeout 300 python3 -m pytest -q -s -m gpu tests/engine/test_turns_gpu.py -p no:cacheprovider 2>&1 \
    | grep -E "episodes|passed|failed|Error" | tee "$OUT/multi_turn_parity.txt"
fi
if want hf-parity; then  # bf16 closeness to transformers per model option, on this GPU (the max diffs printed)
  timeout 300 python3 -m pytest -q -s -m gpu tests/model/test_hf_parity_gpu.py -p no:cacheprovider 2>&1 \
    | tail -20 | tee "$OUT/hf_parity.txt"
fi
if want lora-8b; then  # a qwen3-8b-shaped policy trained with LoRA on one GPU: exact, memory, sync bytes
  timeout 540 $X train configs/quickstart.toml --set model.preset=qwen3-8b --set model.dtype=bfloat16 \
    --set run.device=cuda --set lora.rank=16 --set algorithm.kl_coef=0.05 --set sft.steps=0 --set train.steps=3 \
    --set algorithm.rollouts_per_step=64 --set sampling.max_tokens=64 --set engine.max_model_len=256 \
    --set task.num_eval=8 --set task.eval_every=0 --set run.progress=false --set run.output_dir=/tmp/lora8b 2>&1 \
    | grep -v Warning | tail -8 | tee "$OUT/lora_8b.txt"
  python3 -c "import json; rows=[json.loads(l) for l in open('/tmp/lora8b/metrics.jsonl') if '\"loss\"' in l]
print(json.dumps([{k: r.get(k) for k in ('step','mismatch/num_tokens','mismatch/num_mismatched_tokens','perf/gpu_memory_peak_gb','perf/weight_sync_bytes','perf/tokens_per_s','perf/generate_s','perf/train_s','perf/step_s')} for r in rows]))" \
    | tee -a "$OUT/lora_8b.txt"
fi
if want bench-rl; then  # whole GRPO steps, exact then fast (issue 16, item 3): about 5-6 min in all
  # qwen3-1.7b shape, random init, bf16; 64 prompts x 8 samples; prompts of 64-512 tokens; completion lengths
  # log-normal (median 384) capped at 2048; 1 warm-up + 2 timed steps. The JSON is rewritten after each timed
  # step, so a timeout keeps the finished ones. Then both traces on one plot.
  rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
    --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
    --tokens-per-microbatch 4096"  # 0.3 and 8192 ran out of memory on an H100 (KV + 18 GB of training graphs)
  timeout 270 $X bench rl $rl --mode exact 2>&1 | grep -v Warning | tail -24 | tee "$OUT/bench_rl.txt"
  timeout 300 $X bench rl $rl --mode fast 2>&1 | grep -v Warning | tail -24 | tee -a "$OUT/bench_rl.txt"
  dev=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
  rl_json=""
  for mode in exact fast; do
    f="benchmarks/results/rl-qwen3-1.7b-$mode-$dev.json"
    [[ -f $f ]] && rl_json="$rl_json $f"
  done
  if [[ -n $rl_json ]]; then
    timeout 60 $X bench rl --plot-from $rl_json --plot "benchmarks/results/rl-qwen3-1.7b-concurrency-$dev.png" 2>&1 \
      | tail -2 | tee -a "$OUT/bench_rl.txt"
    cp $rl_json benchmarks/results/rl-qwen3-1.7b-*"$dev".png "$OUT/" 2>/dev/null
  fi
fi
if want parity-split; then  # the engine split over two GPUs (issue 46): tensor parallel on qwen3-0.6b, expert parallel
  # on tiny-moe, each checked token by token against the FSDP2 trainer (NCCL)
  NCCL_NVLS_ENABLE=0 timeout 200 $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 16 \
    --max-tokens 128 --nproc 2 --tensor-parallel 2 --json 2>&1 | grep -v -i warn | tail -3 | tee -a "$OUT/parity_split.txt"
  NCCL_NVLS_ENABLE=0 timeout 150 $X parity --preset tiny-moe --device cuda --dtype bfloat16 --num-prompts 16 \
    --max-tokens 64 --nproc 2 --expert-parallel 2 --json 2>&1 | grep -v -i warn | tail -3 | tee -a "$OUT/parity_split.txt"
fi
if want rl-30b; then  # issue 46: qwen3-30b-a3b, full depth, exact GRPO on two GPUs, full fine-tune as the plan fits it
  # on 2 x H200 (offload streamed by groups, activation checkpointing, experts split over the two engines' ranks)
  # (the whole log under $OUT as it goes: the set-up stages print their seconds and GPU memory; random weights
  # drawn keyed, on threads: the one stream took ~150 s per rank)
  NCCL_NVLS_ENABLE=0 timeout ${RL30_TIMEOUT:-570} $X bench rl --preset qwen3-30b-a3b --mode exact --nproc 2 --prompts 16 \
    --samples 4 --max-tokens 256 --prompt-max 256 --tokens-per-microbatch 4096 --kv-memory-fraction 0.5 --warmup 1 \
    --steps ${RL_STEPS:-1} --set train.offload=optimizer --set train.activation_checkpointing=true \
    --set engine.expert_parallel=${EP:-2} --set model.init_draws=keyed --set train.fsdp_reduce=microbatch \
    ${RL30_SETS:-} --out-dir "$OUT/rl-30b" 2>&1 | tee "$OUT/rl_30b.log" | grep -v -i warn \
    | tail -30 | tee "$OUT/rl_30b.txt"
fi
if want weight-send-8b; then  # issue 44: qwen3-8b's weights trainer -> generator (1 + 1, a small workload: the send
  # is the figure: weight_send_full_gb_per_s, the first send with the group's set-up, and weight_send_s per step)
  NCCL_NVLS_ENABLE=0 timeout 400 $X bench rl --preset qwen3-8b --mode exact --nproc 2 --generator-ranks 1 --prompts 8 \
    --samples 2 --max-tokens 64 --prompt-max 128 --tokens-per-microbatch 4096 --warmup 1 --steps 2 \
    --set model.init_draws=keyed --set train.offload=optimizer \
    --out-dir "$OUT/rl-8b-send" 2>&1 | tee "$OUT/rl_8b_send.log" | grep -v -i warn | tail -24 | tee "$OUT/rl_8b_send.txt"
fi
if want load-8b; then  # issue 46: a preset's keyed random init, and its safetensors checkpoint loaded back, against
  # the disk's sequential read of the same files (pages dropped from the cache first)
  timeout 400 python3 benchmarks/load_bandwidth.py --preset ${LOAD_PRESET:-qwen3-8b} --device cuda \
    --dir /tmp/exactrl-load-ckpt 2>&1 | grep -v -i warn | tail -8 | tee -a "$OUT/load.txt"
fi
if want decode-split; then  # issue 46: decode tok/s at T = 1 and T = 2 (the gathered form and the all-reduce form
  # in the same process), qwen3-8b; then qwen3-30b-a3b at E = T = 2 (DECODE_30B=1)
  # (the same new tokens at T = 1 and 2; the twenty-third session's T = 2 process hung at exit after its figures,
  # graphs holding NCCL collectives: ModelRunner.release_graphs since)
  if [[ -z "${DS_SKIP_T1:-}" ]]; then  # DS_SKIP_T1=1: the T = 2 forms (and the 30B) alone
    timeout 240 python3 benchmarks/decode_split.py --preset qwen3-8b --max-tokens ${DS_TOKENS:-128} 2>&1 \
      | grep -v -i warn | tail -6 | tee -a "$OUT/decode_split.txt"
  fi
  NCCL_NVLS_ENABLE=0 timeout 300 torchrun --standalone --nproc-per-node 2 benchmarks/decode_split.py \
    --preset qwen3-8b --max-tokens ${DS_TOKENS:-128} 2>&1 | grep -v -i warn | tail -10 | tee -a "$OUT/decode_split.txt"
  if [[ -n "${DECODE_30B:-}" ]]; then
    NCCL_NVLS_ENABLE=0 timeout 400 torchrun --standalone --nproc-per-node 2 benchmarks/decode_split.py \
      --preset qwen3-30b-a3b --expert-parallel --forms gathered --max-tokens 64 2>&1 | grep -v -i warn | tail -10 \
      | tee -a "$OUT/decode_split.txt"
  fi
fi
if want parity; then
  timeout 300 $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --mode exact --num-prompts 24 \
    --max-tokens 288 --json 2>&1 | tail -2 | tee -a "$OUT/parity.txt"
  timeout 120 $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --mode fast --num-prompts 8 \
    --max-tokens 64 --json 2>&1 | tail -2 | tee -a "$OUT/parity.txt"
  timeout 300 $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 128 \
    --samples-per-prompt 4 --kv-blocks 96 --prefill-chunk 32 --temperature 0.7 --json 2>&1 | tail -3 | tee -a "$OUT/parity.txt"
fi
if want rollout || want rollout-256 || want rollout-1; then
  cs="256 1"; want rollout || { cs=""; want rollout-256 && cs="256"; want rollout-1 && cs="$cs 1"; }
  for c in $cs; do
    for mode in exact fast; do
      vs=""; [[ $mode == exact ]] && vs="--vs hf"
      timeout 300 $X bench rollout --preset qwen3-0.6b --mode $mode --device cuda --concurrency $c --prompt-len 128 \
        --max-tokens 256 $vs 2>&1 | tail -1 | tee -a "$OUT/rollout.txt"
    done
  done
fi
if want train; then
  for mode in exact fast; do
    vs=""; [[ $mode == exact ]] && vs="--vs hf"
    timeout 300 $X bench train --preset qwen3-0.6b --mode $mode --device cuda --tokens-per-microbatch 8192 --steps 5 \
      $vs 2>&1 | tail -1 | tee -a "$OUT/train.txt"
  done
  # The same exact step without CUDA graphs, in the same session (the host-bound eager step).
  timeout 300 $X bench train --preset qwen3-0.6b --mode exact --device cuda --tokens-per-microbatch 8192 --steps 5 \
    --graphs off 2>&1 | tail -1 | tee -a "$OUT/train.txt"
fi
if want exact-tests; then  # the kernels' and the engine's GPU tests, then exact parity (after a kernel change)
  timeout 420 python3 -m pytest -q -m gpu tests/ops tests/engine -p no:cacheprovider 2>&1 | tail -15 \
    | tee "$OUT/exact_tests.txt"
  timeout 300 $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 128 \
    --json 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/exact_tests.txt"
fi
if want fast-tests; then  # the fast CUDA backend (cuBLAS, FlashAttention varlen): correct numbers, its control
  timeout 300 python3 -m pytest -q -m gpu tests/ops/test_fast_cuda_gpu.py -p no:cacheprovider 2>&1 | tail -15 \
    | tee "$OUT/fast_tests.txt"
  timeout 120 $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --mode fast --num-prompts 8 \
    --max-tokens 64 --json 2>&1 | tail -2 | tee -a "$OUT/fast_tests.txt"
fi
if want probe-gemm; then  # narrower invariant GEMM tiles for decode: same bits as the default config? how fast?
  timeout 400 python3 benchmarks/probe_decode_gemm.py 2>&1 | tail -12 | tee "$OUT/probe_gemm.jsonl"
fi
if want price || want price-rollout; then  # exact / fast rollout at every concurrency, one session
  for c in 1 4 16 64 256; do
    for mode in exact fast; do
      timeout 300 $X bench rollout --preset qwen3-0.6b --mode $mode --device cuda --concurrency $c --prompt-len 128 \
        --max-tokens 256 --json 2>>"$OUT/price_rollout.log" | grep '^{' | tee -a "$OUT/price_rollout.jsonl"
    done
  done
fi
if want price || want price-train; then  # exact / fast / transformers training step at 0.6b and 1.7b
  for p in qwen3-0.6b qwen3-1.7b; do
    for mode in exact fast; do
      vs=""; [[ $mode == fast && $p == qwen3-0.6b ]] && vs="--vs hf"  # transformers at 1.7b beside ours: OOM
      timeout 300 $X bench train --preset $p --mode $mode --device cuda --tokens-per-microbatch 8192 --steps 20 \
        $vs --json 2>>"$OUT/price_train.log" | grep '^{' | tee -a "$OUT/price_train.jsonl"
    done
  done
fi
# Mixture of experts. The qwen3-30b-a3b layer shape with MOE_LAYERS of its 48 layers (a full-depth policy's
# training state does not fit one GPU): a random-init checkpoint written once per machine.
MOE_LAYERS=${MOE_LAYERS:-4}
MOE_DIR=/tmp/qwen3-30b-a3b-l$MOE_LAYERS
moe_model() { [[ -f $MOE_DIR/config.json ]] || $X init-model --preset qwen3-30b-a3b --num-layers $MOE_LAYERS \
  --out $MOE_DIR --dtype bfloat16 2>&1 | tail -1 | tee -a "$OUT/moe_model.txt"; }
if want moe-tests; then  # the MoE kernels and the MoE model on the GPU (bits, graphs, backward, HF closeness)
  timeout 500 python3 -m pytest -q -m gpu tests/ops/test_moe_triton_gpu.py tests/model -k "moe or Moe or MoE" \
    -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/moe_tests.txt"
fi
if want moe-probe; then  # one MoE layer's experts, exact vs fast, decode and training sizes
  timeout 300 python3 benchmarks/probe_moe.py 2>&1 | tail -14 | tee "$OUT/moe_probe.txt"
fi
if want moe-sweep; then
  timeout 300 python3 benchmarks/probe_moe.py --sweep 2>&1 | tail -40 | tee "$OUT/moe_sweep.txt"
fi
if want moe-parity; then  # engine vs trainer, exact (preemption, prefix sharing) and the fast control
  moe_model
  for p in "--preset tiny-moe" "--preset tiny-qwen2-moe" "--model $MOE_DIR"; do
    timeout 300 $X parity $p --device cuda --dtype bfloat16 --num-prompts 16 --max-tokens 128 \
      --samples-per-prompt 4 --kv-blocks 96 --prefill-chunk 32 --temperature 0.7 --json 2>&1 | tail -4 | tee -a "$OUT/moe_parity.txt"
    timeout 200 $X parity $p --device cuda --dtype bfloat16 --mode fast --num-prompts 8 --max-tokens 64 \
      --json 2>&1 | tail -4 | tee -a "$OUT/moe_parity.txt"
  done
fi
if want moe-price; then  # exact / fast MoE rollout at 1/16/64/256 sequences and the training step
  moe_model
  for c in 1 16 64 256; do
    for mode in exact fast; do
      timeout 300 $X bench rollout --model $MOE_DIR --mode $mode --device cuda --concurrency $c --prompt-len 128 \
        --max-tokens 256 --json 2>>"$OUT/moe_price.log" | grep '^{' | tee -a "$OUT/moe_price.jsonl"
    done
  done
  for mode in exact fast; do
    timeout 300 $X bench train --model $MOE_DIR --mode $mode --device cuda --tokens-per-microbatch 8192 --steps 10 \
      --json 2>>"$OUT/moe_price.log" | grep '^{' | tee -a "$OUT/moe_price.jsonl"
  done
fi
if want moe-train-price; then  # the training rows of moe-price alone
  moe_model
  for mode in exact fast; do
    timeout 300 $X bench train --model $MOE_DIR --mode $mode --device cuda --tokens-per-microbatch 8192 --steps 10 \
      --json 2>>"$OUT/moe_price.log" | grep '^{' | tee -a "$OUT/moe_train_price.jsonl"
  done
fi
if want moe-rl; then  # exact GRPO steps on the MoE shape: full fine-tune, then LoRA on the attention projections
  moe_model
  base="--set model.preset=none --set model.path=$MOE_DIR --set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0
    --set train.save_every=0 --set train.save_at_end=false --set train.steps=3 --set algorithm.rollouts_per_step=64 --set task.num_eval=16 --set task.eval_every=0
    --set run.progress=false --set engine.max_model_len=256 --set sampling.max_tokens=64"
  timeout 400 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/moe-full 2>&1 \
    | grep -v Warning | tail -4 | tee "$OUT/moe_rl.txt"
  timeout 400 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/moe-lora --set lora.rank=16 \
    --set 'lora.target_modules=["q_proj","k_proj","v_proj","o_proj"]' 2>&1 | grep -v Warning | tail -4 \
    | tee -a "$OUT/moe_rl.txt"
  for d in moe-full moe-lora; do
    python3 -c "import json; rows=[json.loads(l) for l in open('$OUT/$d/metrics.jsonl') if '\"loss\"' in l]
print('$d', json.dumps([{k: r.get(k) for k in ('step','mismatch/num_tokens','mismatch/num_mismatched_tokens','perf/gpu_memory_peak_gb','perf/generate_s','perf/train_s','moe/load_max_over_mean','moe/router_entropy')} for r in rows]))" \
      | tee -a "$OUT/moe_rl.txt"
    rm -rf "$OUT/$d"
  done
fi
if want bench-rl-offpolicy; then  # whole exact GRPO steps, synchronous (k = 0) then one-step-off (k = 1)
  rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
    --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
    --tokens-per-microbatch 4096 --mode exact"
  for k in 0 1; do
    timeout 280 $X bench rl $rl --max-off-policy-steps $k 2>&1 | grep -v Warning | tail -30 | tee -a "$OUT/bench_rl_offpolicy.txt"
  done
  cp benchmarks/results/rl-qwen3-1.7b-*exact*.json "$OUT/" 2>/dev/null
fi
if want probes-overlap; then  # can generation share one GPU with training? stream priority, SMs left out of grids
  timeout 120 python3 benchmarks/probe_priority.py 2>&1 | tail -12 | tee "$OUT/probe_priority.txt"
  timeout 200 python3 benchmarks/probe_sm_reserve.py 2>&1 | tail -14 | tee "$OUT/probe_sm_reserve.txt"
  grep -h '^{"probe"' "$OUT/probe_priority.txt" "$OUT/probe_sm_reserve.txt" \
    > "benchmarks/results/probe-overlap-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-').jsonl"
fi
if want fsdp-mb; then  # FSDP2 at world size 1 vs today's step, at the default microbatch and at 32,768 tokens
  for preset in ${FSDP_PRESETS:-qwen3-0.6b qwen3-1.7b}; do for mb in ${FSDP_MBS:-8192 32768}; do
    timeout 300 $X bench train --fsdp --preset $preset --device cuda --tokens-per-microbatch $mb --steps 5 --json \
      2>&1 | grep -v Warning | tail -6 | tee -a "$OUT/fsdp_mb.txt"
  done; done
fi
if want bench-rl-overlap; then  # whole exact GRPO steps, synchronous then the tail overlap (algorithm.overlap)
  rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
    --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
    --tokens-per-microbatch 4096 --mode exact"
  for ov in none tail; do
    timeout 280 $X bench rl $rl --overlap $ov 2>&1 | grep -v Warning | tail -30 | tee -a "$OUT/bench_rl_overlap.txt"
  done
  cp benchmarks/results/rl-qwen3-1.7b-*exact*.json "$OUT/" 2>/dev/null
fi
if want bench-rl-partial; then  # partial rollouts (k = 2, cut by count, resumed by recompute) vs the synchronous step
  rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
    --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
    --tokens-per-microbatch 4096 --mode exact"
  for mode in "--max-off-policy-steps 0" "--max-off-policy-steps 2 --partial-rollouts"; do
    timeout 280 $X bench rl $rl $mode 2>&1 | grep -v Warning | tail -30 | tee -a "$OUT/bench_rl_partial.txt"
  done
fi
if want kv-sweep; then  # the README's bench rl at its defaults but the KV fraction (memory phases on): can it rise?
  for f in ${KV_FRACTIONS:-0.3 0.45 0.6}; do
    timeout 200 $X bench rl --preset qwen3-1.7b --mode exact --warmup 1 --steps 1 --kv-memory-fraction $f --json \
      2>&1 | grep -v Warning | tail -16 | tee -a "$OUT/kv_sweep.txt"
  done
fi
if want pin-8b; then  # exact-size page-locked offload buffers, then the qwen3-8b full fine-tune on one GPU with them
  timeout 90 python3 -m pytest -q -m gpu tests/train/test_pinned.py -p no:cacheprovider 2>&1 | tail -5 | tee "$OUT/pin.txt"
  base="--set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0 --set train.steps=2
    --set algorithm.rollouts_per_step=128 --set task.num_eval=16 --set task.eval_every=0 --set run.progress=false
    --set engine.max_model_len=1024 --set sampling.max_tokens=512 --set train.save_at_end=false"
  big="--set model.preset=qwen3-8b --set train.offload=optimizer --set train.activation_checkpointing=true"
  timeout 490 python3 benchmarks/plan_check.py configs/quickstart.toml $base $big --out-dir "$OUT/plan-8b" 2>&1 \
    | grep -v -i warn | tail -24 | tee -a "$OUT/pin.txt"
  python3 benchmarks/step_split.py "$OUT/plan-8b" 2>&1 | tee -a "$OUT/pin.txt"
fi
if want offload-cost; then  # qwen3-1.7b exact GRPO steps with the optimizer state on the device, then in host memory
  base="--set model.preset=qwen3-1.7b --set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0
    --set train.steps=4 --set algorithm.rollouts_per_step=128 --set task.num_eval=16 --set task.eval_every=0
    --set run.progress=false --set engine.max_model_len=1024 --set sampling.max_tokens=512 --set train.save_at_end=false"
  for o in none optimizer none optimizer; do
    d="$OUT/off-$o-$RANDOM"
    timeout 240 $X train configs/quickstart.toml $base --set train.offload=$o --set run.output_dir=$d 2>&1 \
      | grep -v -i warn | tail -2 | tee -a "$OUT/offload_cost.txt"
    python3 benchmarks/step_split.py "$d" 2>&1 | tee -a "$OUT/offload_cost.txt"
  done
fi
if want plan-trace; then  # plan vs measured per phase, with what is live at the training peak by allocating line
  base="--set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0 --set train.steps=2
    --set algorithm.rollouts_per_step=128 --set task.num_eval=16 --set task.eval_every=0 --set run.progress=false
    --set engine.max_model_len=1024 --set sampling.max_tokens=512 --set train.save_at_end=false"
  for run in "qwen3-1.7b optimizer true" "qwen3-0.6b none false"; do set -- $run
    timeout 240 python3 benchmarks/plan_check.py configs/quickstart.toml $base --set model.preset=$1 \
      --set train.offload=$2 --set train.activation_checkpointing=$3 --trace training --out-dir "$OUT/trace-$1" 2>&1 \
      | grep -v -i warn | tail -48 | grep -v '^{' | tee -a "$OUT/plan_trace.txt"
  done
fi
if want train-eager; then  # today's training step with and without its CUDA graphs (what FSDP2's eager step pays)
  for g in on off; do
    timeout 120 $X bench train --preset qwen3-0.6b --device cuda --tokens-per-microbatch 8192 --steps 5 --graphs $g \
      --json 2>&1 | grep -v Warning | tail -3 | tee -a "$OUT/train_eager.txt"
  done
fi
if want fsdp-offload; then  # train.offload = "optimizer" under torchrun (FSDP2, NCCL) on the GPU: exact, resume bitwise
  base="--set model.preset=qwen3-0.6b --set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0
    --set train.steps=3 --set train.save_every=1 --set algorithm.rollouts_per_step=64 --set task.num_eval=8
    --set task.eval_every=0 --set run.progress=false --set engine.max_model_len=256 --set sampling.max_tokens=64
    --set train.offload=optimizer"
  timeout 150 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/fo-full --nproc ${NPROC:-1} 2>&1 \
    | grep -v Warning | tail -3 | tee "$OUT/fsdp_offload.txt"
  python3 -c "import sys; sys.path.insert(0, 'tests/distributed'); from pathlib import Path; import _runs
_runs.crashed_after(Path('$OUT/fo-full'), Path('$OUT/fo-resumed'), 2)"
  timeout 150 $X train configs/quickstart.toml $base --set run.output_dir=$OUT/fo-resumed --nproc ${NPROC:-1} --resume 2>&1 \
    | grep -v Warning | tail -3 | tee -a "$OUT/fsdp_offload.txt"
  python3 -c "import sys; sys.path.insert(0, 'tests/distributed'); from pathlib import Path; import _runs
a, b = Path('$OUT/fo-full'), Path('$OUT/fo-resumed')
print('fsdp offload resume bitwise:', _runs.same(a, b), 'mismatched:', _runs.mismatched(a), _runs.mismatched(b))" \
    2>&1 | tee -a "$OUT/fsdp_offload.txt"
fi
if want train-vs-torch; then  # exactrl's step vs a compiled stock-PyTorch step of the same shape (issue 31)
  # exactrl/bench_torch.py: cuBLAS, SDPA flash forward and backward, torch.compile per block and for head + loss,
  # fused AdamW on fp32 masters. Each call compiles the baseline once (torch_compile_s, not in the timed steps).
  for P in qwen3-0.6b qwen3-1.7b; do
    for mode in exact fast; do
      timeout 240 $X bench train --preset $P --mode $mode --device cuda --tokens-per-microbatch 8192 --steps 10 \
        --vs torch --json 2>&1 | grep -E '^(step |exactrl \(|torch \(compiled|\{)|Error|error:' | tee -a "$OUT/train_vs_torch.txt"
    done
  done
fi
if want profile-vs-torch; then  # GPU time by category: exactrl exact / fast vs the compiled stock step (issue 31)
  for P in ${PROFILE_PRESETS:-qwen3-0.6b qwen3-1.7b}; do
    timeout 300 python3 benchmarks/profile_vs_torch.py --preset $P 2>&1 | grep -v -E 'Warning|USDT' \
      | tee -a "$OUT/profile_vs_torch.txt" | tail -60
  done
fi
if want train-table; then  # exact / fast / compiled stock / transformers, alternating, repeated (issue 31)
  for P in ${TABLE_PRESETS:-qwen3-0.6b qwen3-1.7b}; do
    timeout 540 python3 benchmarks/train_vs_torch.py --preset $P --repeats ${REPEATS:-3} --steps 10 2>&1 \
      | grep -E '^(repeat|step|exact|fast|stock|hf|qwen|\{)|Error|error:' | tee -a "$OUT/train_table.txt"
  done
fi
if want host-table; then  # issue 45's table: per preset and busy cores (BUSY, default "0 1"), the step's GPU-busy
  # fraction (probe_host_side.py), then exact / fast / compiled stock in each of three separate processes
  for P in ${TABLE_PRESETS:-qwen3-0.6b qwen3-1.7b}; do
    for B in ${BUSY:-0 1}; do
      timeout 200 python3 benchmarks/probe_host_side.py --preset $P --busy-cores $B 2>&1 | grep '^{' \
        | tee -a "$OUT/host_busy.jsonl"
      for proc in 1 2 3; do
        timeout 300 python3 benchmarks/train_vs_torch.py --preset $P --which exact fast stock --repeats 1 --steps 10 \
          --busy-cores $B 2>&1 | grep -E '^\{|Error' | sed "s/^{/{\"process\": $proc, \"busy_cores\": $B, /" \
          | tee -a "$OUT/host_table.jsonl"
      done
    done
  done
fi
if want probe-adamw; then  # the AdamW kernel's launch shape against its memory traffic
  timeout 200 python3 benchmarks/probe_adamw.py --preset qwen3-1.7b 2>&1 | tail -9 | tee "$OUT/probe_adamw.txt"
fi
if want fsdp-ws2; then  # FSDP2 at world sizes 1 and 2 (two GPUs) at the microbatch the plan picks by default
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')
  for a in "qwen3-0.6b 32768" "qwen3-1.7b 16384"; do set -- $a
    timeout 300 $X bench train --fsdp --preset $1 --device cuda --tokens-per-microbatch $2 --steps 5 --json 2>&1 \
      | grep -E '^(path|today|FSDP2|ratio)|Error' | tee -a "$OUT/fsdp_ws2.txt"
    cp "benchmarks/results/train-$1-fsdp-exact-$gpu.json" "$OUT/fsdp-ws1-$1.json"
    timeout 300 $X bench train --fsdp --nproc 2 --preset $1 --device cuda --tokens-per-microbatch $2 --steps 5 --json \
      --baseline "$OUT/fsdp-ws1-$1.json" 2>&1 | grep -E '^(rank|  *[0-9]|world|scaling|speedup)|Error|^\{' \
      | tee -a "$OUT/fsdp_ws2.txt"
  done
fi
if want kernels; then
  timeout 300 python3 benchmarks/bench_kernels.py --skip-configs --out "$OUT/kernels.jsonl" 2>&1 | tail -40 | tee "$OUT/kernels.txt"
fi
if want matmul-configs; then
  timeout 300 python3 benchmarks/bench_kernels.py --only-matmul-configs --out "$OUT/matmul_configs.jsonl" 2>&1 \
    | tail -15 | tee "$OUT/matmul_configs.txt"
fi
if want attention-configs; then
  timeout 300 python3 benchmarks/bench_kernels.py --only-attention-configs --out "$OUT/attention_configs.jsonl" 2>&1 \
    | tail -40 | tee "$OUT/attention_configs.txt"
fi
if want attention-fwd-configs; then
  timeout 300 python3 benchmarks/bench_kernels.py --only-attention-configs --forward-only \
    --out "$OUT/attention_fwd_configs.jsonl" 2>&1 | tail -20 | tee "$OUT/attention_fwd_configs.txt"
fi
if want profile-decode; then  # qwen3-0.6b decode, GPU time by kernel at CS (default "1 256") sequences, PDL off (with it
  # on, the profiler counts a kernel's wait for its predecessor as the kernel's own time)
  for c in ${CS:-1 256}; do
    EXACTRL_PDL=0 timeout 240 python3 benchmarks/profile_steps.py --what rollout --mode exact --concurrency $c \
      --max-tokens 128 --top ${TOP:-22} 2>&1 | grep -v Warning | tail -$(( ${TOP:-22} + 8 )) | tee -a "$OUT/profile_decode.txt"
  done
fi
if want probe-mid-bk; then  # K steps of 128 for the GEMM rows between decode and training (65..512)
  timeout 300 python3 benchmarks/probe_decode_gemm.py --mid-bk 2>&1 | grep '^{' | tee "$OUT/probe_mid_bk.jsonl"
fi
if want profile; then
  timeout 300 python3 benchmarks/profile_steps.py --mode exact 2>&1 | tail -70 | tee "$OUT/profile.txt"
fi
if want tail-check; then  # after a sampler or engine change: its GPU tests, exact/fast rollout at 1 and 256
  timeout 150 python3 -m pytest -q -m gpu tests/ops/test_triton_sampling.py tests/engine/test_sampler.py \
    tests/engine/test_decode_graphs.py -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/tail_tests.txt"
  for c in 1 256; do for mode in exact fast; do
    timeout 120 $X bench rollout --preset qwen3-0.6b --mode $mode --device cuda --concurrency $c --prompt-len 128 \
      --max-tokens 256 --json 2>>"$OUT/tail_rollout.log" | grep '^{' | tee -a "$OUT/tail_rollout.jsonl"
  done; done
fi
if want bench-rl-exact; then  # bench rl, exact mode only
  rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
    --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
    --tokens-per-microbatch 4096 --out-dir $OUT/rl-exact"
  timeout 270 $X bench rl $rl --mode exact 2>&1 | grep -v -i warn | tail -22 | tee "$OUT/bench_rl_exact.txt"
fi
if want bench-rl-profile; then  # bench rl's generate stage by kernel, exact and fast (the last timed step profiled)
  rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
    --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
    --tokens-per-microbatch 4096 --profile --out-dir $OUT/rl-profile"
  for mode in exact fast; do
    timeout 290 $X bench rl $rl --mode $mode 2>&1 | grep -v Warning | tail -40 | tee -a "$OUT/bench_rl_profile.txt"
  done
fi
if want profile-gen; then  # qwen3-1.7b generation, exact vs fast, GPU time by kernel at 512 / 64 / 8 sequences
  for c in 512 64 8; do for m in exact fast; do
    timeout 240 python3 benchmarks/profile_steps.py --preset qwen3-1.7b --mode $m --what rollout --concurrency $c \
      --prompt-len 256 --max-tokens 256 --top 14 2>&1 | grep -v Warning | tail -18 | tee -a "$OUT/profile_gen.txt"
  done; done
fi
if want probe-train; then  # tenth session: where the training step's time goes (trace with idle gaps) and its GEMMs
  timeout 200 python3 benchmarks/profile_steps.py --mode exact --what train --trace "$OUT/traces" --top 30 2>&1 \
    | grep -v Warning | tail -80 | tee "$OUT/profile_train.txt"
  timeout 150 python3 benchmarks/probe_train_gemm.py 2>&1 | grep -v Warning | tee "$OUT/probe_train_gemm.jsonl"
fi
if want probe-decode; then  # tenth session: decode attention tiles and deeper-K decode GEMM tiles (bits and time)
  timeout 200 python3 benchmarks/probe_decode_attn.py 2>&1 | grep -v Warning | tee "$OUT/probe_decode_attn.jsonl"
  timeout 200 python3 benchmarks/probe_decode_gemm.py --bk 2>&1 | grep -v Warning | tee "$OUT/probe_gemm_bk.jsonl"
  timeout 150 python3 benchmarks/profile_steps.py --mode exact --what rollout --concurrency 1 --max-tokens 64 \
    --trace "$OUT/traces" --top 20 2>&1 | grep -v Warning | tail -60 | tee "$OUT/profile_c1.txt"
fi
if want split-check; then  # tenth session: split-KV decode (fixed key chunks): GPU tests, chunk-size probe, parity
  timeout 300 python3 -m pytest -q -m gpu tests/ops/test_triton_gpu.py tests/engine/test_decode_graphs.py \
    tests/train/test_graphs_gpu.py tests/train/test_optim_gpu.py -p no:cacheprovider 2>&1 | tail -6 \
    | tee "$OUT/split_tests.txt"
  timeout 200 python3 benchmarks/probe_decode_attn.py --split 2>&1 | grep '^{' | tee "$OUT/probe_split.jsonl"
  timeout 200 $X parity --preset qwen3-0.6b --device cuda --dtype bfloat16 --num-prompts 4 --max-tokens 1536 \
    --json 2>&1 | tail -2 | tee -a "$OUT/parity_long.txt"
  for c in 1 16; do for mode in exact fast; do  # the long tail: few sequences, long contexts
    timeout 120 $X bench rollout --preset qwen3-0.6b --mode $mode --device cuda --concurrency $c --prompt-len 1024 \
      --max-tokens 512 --json 2>>"$OUT/split_rollout.log" | grep '^{' | tee -a "$OUT/split_rollout.jsonl"
  done; done
fi
if want split-ab; then  # split-KV decode on and off (same bits), few sequences with long contexts, exact mode
  for p in qwen3-0.6b qwen3-1.7b; do for c in 1 16; do for sk in off auto; do
    timeout 120 $X bench rollout --preset $p --mode exact --device cuda --concurrency $c --prompt-len 1024 \
      --max-tokens 512 --split-kv $sk --json 2>>"$OUT/split_ab.log" | grep '^{' | tee -a "$OUT/split_ab.jsonl"
  done; done; done
fi
if want bench-rl-nosplit; then  # bench rl, exact, split-KV decode off: the before/after of the split on the RL step
  rl="--preset qwen3-1.7b --device cuda --dtype bfloat16 --prompts 64 --samples 8 --prompt-min 64 --prompt-max 512
    --max-tokens 2048 --completion-median 384 --completion-sigma 0.8 --warmup 1 --steps 2 --kv-memory-fraction 0.2
    --tokens-per-microbatch 4096 --out-dir $OUT/rl-nosplit"
  timeout 270 $X bench rl $rl --mode exact --split-kv off 2>&1 | grep -v -i warn | tail -22 | tee "$OUT/bench_rl_nosplit.txt"
fi
if want split-wide; then  # split-KV vs not at 16..256 sequences with the engine's wide slot table (2,560 keys)
  timeout 200 python3 benchmarks/probe_decode_attn.py --wide 2>&1 | grep '^{' | tee "$OUT/probe_split_wide.jsonl"
fi
if want plan-check; then  # the memory plan (exactrl plan) vs measured per-phase peaks of short exact train runs
  # qwen3-0.6b and qwen3-1.7b, bf16, offload off and on (1.7b), default microbatch and graphs; target: measured
  # allocated within 10% of predicted per phase. Also the plans the issue names (8B on one GPU, 30B-A3B on 8).
  base="--set model.dtype=bfloat16 --set run.device=cuda --set sft.steps=0 --set train.steps=2
    --set algorithm.rollouts_per_step=128 --set task.num_eval=16 --set task.eval_every=0 --set run.progress=false
    --set engine.max_model_len=1024 --set sampling.max_tokens=512 --set train.save_at_end=false"
  for run in "qwen3-0.6b none" "qwen3-1.7b none" "qwen3-1.7b optimizer"; do set -- $run
    $X plan configs/quickstart.toml $base --set model.preset=$1 --set train.offload=$2 2>&1 | tail -16 \
      | tee -a "$OUT/plan_check.txt"
    timeout 400 python3 benchmarks/plan_check.py configs/quickstart.toml $base --set model.preset=$1 \
      --set train.offload=$2 --out-dir "$OUT/plan-$1-$2" 2>&1 | grep -v -i warn | tail -24 | tee -a "$OUT/plan_check.txt"
  done
  # The README's `exactrl bench rl --preset qwen3-1.7b --mode exact` at its defaults (kv 0.3, microbatch 8192), which
  # ran out of memory on an H100 before the memory phases (issue 32); the KV cache is released while it trains.
  timeout 560 python3 benchmarks/plan_check.py --bench-rl -- --warmup 1 --steps 1 2>&1 | grep -v -i warn | tail -24 \
    | tee -a "$OUT/plan_check.txt"
  # A qwen3-8b full fine-tune on one GPU: optimizer state in host memory, activation checkpointing.
  big="--set model.preset=qwen3-8b --set train.offload=optimizer --set train.activation_checkpointing=true"
  $X plan configs/quickstart.toml $base $big 2>&1 | tail -16 | tee -a "$OUT/plan_check.txt"
  timeout 490 python3 benchmarks/plan_check.py configs/quickstart.toml $base $big --out-dir "$OUT/plan-8b" 2>&1 \
    | grep -v -i warn | tail -24 | tee -a "$OUT/plan_check.txt"
  $X plan configs/quickstart.toml $base --set model.preset=qwen3-30b-a3b --nproc 8 --gpu-memory 79.6 2>&1 \
    | tail -16 | tee -a "$OUT/plan_check.txt"
  grep '^{"plan_check"' "$OUT/plan_check.txt" > benchmarks/results/plan_check.jsonl
fi
if want bench-rl-2gpu; then  # two GPUs: colocated world size 2, then 1 generator + 1 trainer at k = 1 and k = 0
  # against it (issue 44; RL_KS: which, p = partial rollouts). PYSPY=path: py-spy samples the trainer (rank 0) for 30 s of the k = 1 run's timed steps
  # (per thread, GIL holders marked), to see what its host does while the generator samples.
  rl="--preset ${RL_PRESET:-qwen3-1.7b} --mode exact --kv-memory-fraction 0.2 --tokens-per-microbatch 4096 --nproc 2
    --warmup 1 --steps ${RL_STEPS:-2}"
  timeout 300 $X bench rl $rl --out-dir "$OUT/rl-colocated" 2>&1 | grep -v -i warn | tail -14 | tee -a "$OUT/rl_2gpu.txt"
  base=$(ls "$OUT"/rl-colocated/*.json | head -1)
  for k in ${RL_KS:-1 0}; do  # k = p: partial rollouts (k = 2)
    mode="--max-off-policy-steps $k"; [[ $k == p ]] && mode="--max-off-policy-steps 2 --partial-rollouts"
    timeout 400 $X bench rl $rl --generator-ranks 1 $mode --baseline "$base" \
      --out-dir "$OUT/rl-gen1-k$k" > "$OUT/rl_gen1_k$k.log" 2>&1 &
    bench=$!
    if [[ -n "${PYSPY:-}" && $k == 1 ]]; then
      sleep ${PYSPY_AFTER:-95}
      for p in $(pgrep -f "exactrl.cli bench rl"); do
        if tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx 'RANK=0'; then
          "$PYSPY" record --pid $p --duration 30 --rate 40 --threads --gil --format raw -o "$OUT/pyspy_trainer_gil.txt" \
            > "$OUT/pyspy.log" 2>&1 &
          "$PYSPY" record --pid $p --duration 30 --rate 40 --threads --idle --format raw \
            -o "$OUT/pyspy_trainer_all.txt" >> "$OUT/pyspy.log" 2>&1
          wait
        fi
      done
    fi
    wait $bench
    grep -v -i warn "$OUT/rl_gen1_k$k.log" | tail -16 | tee -a "$OUT/rl_2gpu.txt"
  done
fi
tar czf "$OUT/results.tgz" benchmarks/results
