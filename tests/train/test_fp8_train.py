"""fp8 in training (model.precision = "fp8"): the optimizer re-quantizes the fp8 weights from its fp32 masters
after each step, and a short GRPO run keeps the rollout/trainer mismatch guard at 0 on every step."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from exactrl.config import apply_overrides, config_from_dict
from exactrl.model.config import PRESETS
from exactrl.model.precision import apply_precision
from exactrl.model.qwen import build_model
from exactrl.ops.batch import AttentionBatch
from exactrl.ops.fp8 import quantize_weight
from exactrl.train.loop import train
from exactrl.train.optim import MasterAdamW


def test_step_requantizes_from_the_weights_every_holder_shares():
    """After a step the fp8 copy is the quantized model weight (bf16), not the quantized fp32 master: a resume
    (the checkpoint holds the weights), the one-step-off behaviour copy and a replay quantize the same weights, so
    they hold the same fp8 bits. Quantized from the master, the codes differ (the negative control below)."""
    model = apply_precision(build_model(PRESETS["tiny"], dtype=torch.bfloat16), "fp8")
    opt = MasterAdamW(model, lr=1e-2)
    ids = torch.arange(24) % model.config.vocab_size
    h = model(ids, torch.arange(24), AttentionBatch.packed([24]))
    lp, _ = model.logprobs(h[:-1], ids[1:])
    (-lp.mean()).backward()
    assert (
        model.model.layers[0].self_attn.o_proj.weight.grad is not None
    )  # straight-through reached the weight
    opt.clip_and_step(1.0)
    i = next(i for i, p in enumerate(opt.params) if p is model.model.layers[0].mlp.down_proj.weight)
    param, master = opt.params[i], opt.master[i]
    entry = model.ops._entry(param)
    q_master, s_master = quantize_weight(master)
    q_param, s_param = quantize_weight(param.float())
    # the bf16 copy rounds the master: quantized from it, other blocks (so the check below can fail)
    assert not (torch.equal(q_param.float(), q_master.float()) and torch.equal(s_param, s_master))
    assert torch.equal(entry.q.float(), q_param.float()) and torch.equal(entry.scale, s_param)
    # A second holder of the same weights (a resumed run, the behaviour copy) gets the same fp8 bits.
    twin = apply_precision(build_model(PRESETS["tiny"], dtype=torch.bfloat16), "fp8")
    twin.load_state_dict(model.state_dict())
    checked = 0
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        ea, eb = (
            model.ops._entry(a),
            twin.ops._entry(b),
        )  # _entry: re-quantized if the weight was written since
        if ea is not None and eb is not None:
            assert torch.equal(ea.q.float(), eb.q.float()) and torch.equal(ea.scale, eb.scale), name
            checked += 1
    assert checked == model.ops.num_weights


BASE = {
    "run": {
        "name": "fp8",
        "seed": 0,
        "device": "cpu",
        "exact": True,
        "tensorboard": False,
        "progress": False,
    },
    "model": {"preset": "tiny", "dtype": "bfloat16", "precision": "fp8"},
    "engine": {"block_size": 16, "max_num_seqs": 64, "max_model_len": 48},
    "sampling": {"temperature": 1.0, "max_tokens": 4},
    "task": {
        "name": "arithmetic",
        "arithmetic_max_operand": 30,
        "arithmetic_ops": ["+"],
        "arithmetic_num_terms": 2,
        "use_chat_template": False,
        "num_eval": 2,
        "eval_every": 0,
        "max_prompt_tokens": 16,
    },
    "algorithm": {"name": "grpo", "group_size": 4, "rollouts_per_step": 8, "kl_coef": 0.05},
    "train": {"steps": 2, "lr": 3e-4, "max_tokens_per_microbatch": 4096, "save_every": 20},
    "sft": {"steps": 0},
}


def test_grpo_in_fp8_guard_at_zero(tmp_path: Path):
    """bf16 weights with fp32 masters, fp8 projections, a KL reference (a deep copy, fp8 too): every step's
    rollout logprobs equal the trainer's."""
    cfg = apply_overrides(config_from_dict(BASE), [f"run.output_dir={tmp_path}"])
    cfg.validate()
    summary = train(cfg, out=lambda *a: None)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["mismatch/num_tokens"] > 0 and r["mismatch/num_mismatched_tokens"] == 0, r
    assert summary["mismatched_tokens_total"] == 0
