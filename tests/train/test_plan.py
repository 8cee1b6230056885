"""The memory plan (`exactrl plan`, exactrl/train/memory.py) and optimizer offload (`train.offload`).

What a CPU can show: the plan's weight, master, moment and gradient bytes equal the bytes of the tensors a run
builds (tiny, tiny-moe, LoRA, critic); a config that cannot fit is refused with settings that do fit; the
qwen3-30b-a3b plan for 8 x 80 GB follows the formula; offload moves the optimizer state out of the step's buffers
and back, and changes no bit of a run. What it cannot: activation peaks (no reliable CPU allocator peak; the
activation term is checked on the GPU by `bash benchmarks/gpu.sh plan-check`), pinned memory and the
asynchrony of the copies.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exactrl.config import apply_overrides, config_from_dict, load_config
from exactrl.model.config import preset
from exactrl.model.lora import apply_lora_config
from exactrl.model.qwen import CausalLM, build_model
from exactrl.train.critic import ValueModel
from exactrl.train.memory import (
    CUDA_CONTEXT_BYTES,
    GiB,
    MemoryPlanError,
    activation_bytes_per_token,
    microbatch_tokens,
    pinned_bytes,
    plan_memory,
)
from exactrl.train.memory_fit import check_before_loading, make_plan
from exactrl.train.optim import OFFLOAD_CHUNK_BYTES, MasterAdamW, offload_chunks

ROOT = Path(__file__).resolve().parents[2]


def run_cfg(*overrides: str):
    cfg = apply_overrides(
        config_from_dict({"model": {"preset": "tiny", "dtype": "bfloat16"}}), list(overrides)
    )
    cfg.validate()
    return cfg


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def stepped(model: torch.nn.Module, **kw) -> MasterAdamW:
    """An optimizer over `model` after one step (AdamW makes its moments at the first step)."""
    opt = MasterAdamW(model, lr=1e-3, **kw)
    for p in opt.params:
        p.grad = torch.full_like(p, 0.01)
    opt.clip_and_step(1.0)
    return opt


# ----------------------------------------------------------------------------------------------------------
# The plan's byte counts against real tensors
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny-moe", "tiny-qwen2-moe"])
def test_state_bytes_equal_the_real_tensors(name):
    cfg = run_cfg(f"model.preset={name}")
    model = build_model(preset(name), dtype=torch.bfloat16)
    opt = stepped(model)
    terms = plan_memory(cfg, gpu_memory=None, device="cuda").phase("optimizer").terms
    assert terms["policy_weights"] == nbytes(model.parameters())
    assert terms["policy_masters_fp32"] == nbytes(opt.master)
    moments = [opt.opt.state[m][k] for m in opt.master for k in ("exp_avg", "exp_avg_sq")]
    assert terms["policy_adamw_moments"] == nbytes(moments)
    # The trainer's persistent gradients: one per trainable parameter in the model dtype.
    assert terms["policy_grads"] == nbytes(opt.params)
    # With offload the step holds one group of masters and moments at a time.
    offloaded = apply_overrides(cfg, ["train.offload=optimizer"])
    streamed = plan_memory(offloaded, device="cuda").phase("optimizer")
    on = stepped(build_model(preset(name), dtype=torch.bfloat16), offload="optimizer")
    groups = [nbytes(t for k, t in on._offloaded(idx)) for idx in on._chunks]
    assert streamed.terms["optimizer_state_chunk"] == max(groups)
    assert "policy_adamw_moments" not in streamed.terms


def test_pinned_host_bytes_are_the_offloaded_tensors():
    """train.offload = "optimizer": the plan's host term is one pinned buffer per master and moment the optimizer
    really moves to the host (counted on its host buffers after a step), at its exact size (page-locked in place,
    exactrl/train/pinned.py); with fp32 weights only the moments move."""
    assert [pinned_bytes(n) for n in (0, 1, 3, 4097, 2**30)] == [0, 1, 3, 4097, 2**30]  # exact, not rounded
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        cfg = run_cfg(f"model.dtype={name}", "train.offload=optimizer", "model.preset=tiny-moe")
        on = stepped(build_model(preset("tiny-moe"), dtype=dtype), offload="optimizer")
        assert on.on_host and on._host
        real = sum(pinned_bytes(t.numel() * t.element_size()) for t in on._host.values())
        assert plan_memory(cfg, device="cuda").host_pinned == real
    assert plan_memory(run_cfg("train.offload=none"), device="cuda").host_pinned == 0


def test_offload_that_does_not_fit_the_host_is_refused_by_name():
    """A qwen3-8b full fine-tune with its optimizer state offloaded (91.5 GiB pinned at the exact size; torch's
    power-of-two blocks took 125.25 GiB and the host's OOM killer ended the run on a 125 GiB machine) fits an 80 GB
    GPU and a 125 GiB host, not a 96 GiB one; the refusal names host memory and offers settings that fit."""
    cfg = apply_overrides(
        config_from_dict({"model": {"preset": "qwen3-8b", "dtype": "bfloat16"}}),
        [
            "train.offload=optimizer",
            "train.activation_checkpointing=true",
            "algorithm.rollouts_per_step=128",
            "engine.max_model_len=1024",
            "sampling.max_tokens=512",
        ],
    )
    cfg.validate()
    gpu = int(79.18 * GiB)
    small = make_plan(cfg, gpu_memory=gpu, host_memory=96 * GiB)
    assert small.device_fits and not small.host_fits and not small.fits
    assert round(small.host_pinned / GiB, 2) == 91.54
    why = small.refusal()
    assert "pinned host memory" in why and "91.54 GiB" in why and "88.00 GiB" in why
    assert any(s.startswith("lora.rank=16") for s in small.suggestions)
    # More ranks, offload kept: each rank pins its moment shards only, two ranks share the host.
    assert any(s.startswith("--nproc 2 (FSDP2") for s in small.suggestions)
    two = make_plan(cfg, world_size=2, gpu_memory=gpu, host_memory=96 * GiB)
    assert two.fits and two.host_ranks == 2 and 2 * two.host_pinned < small.host_pinned
    big = make_plan(cfg, gpu_memory=gpu, host_memory=125 * GiB)
    assert big.fits and not big.suggestions


def test_lora_and_critic_bytes_equal_the_real_tensors():
    cfg = run_cfg("lora.rank=4", "algorithm.name=ppo", "algorithm.group_size=1", "algorithm.kl_coef=0.1")
    model = build_model(preset("tiny"), dtype=torch.bfloat16)
    critic = ValueModel.from_policy(model)  # before LoRA, as the run makes it
    apply_lora_config(model, cfg.lora)
    opt, copt = stepped(model), stepped(critic)
    t = plan_memory(cfg, gpu_memory=None, device="cuda").phase("optimizer").terms
    assert t["policy_weights"] == nbytes(model.parameters())  # frozen base + adapters, model dtype
    assert t["policy_masters_fp32"] == nbytes(opt.master)  # the adapters' only
    assert t["policy_adamw_moments"] == 2 * nbytes(opt.master)
    assert "reference_model" not in t  # LoRA's reference is the base with the adapters off
    assert t["critic_weights"] == nbytes(critic.parameters())
    assert t["critic_masters_fp32"] == nbytes(copt.master)  # the fp32 value head too
    moments = [copt.opt.state[m][k] for m in copt.master for k in ("exp_avg", "exp_avg_sq")]
    assert t["critic_adamw_moments"] == nbytes(moments)


def test_reference_model_and_fp32_weights():
    cfg = run_cfg("model.dtype=float32", "algorithm.kl_coef=0.1")
    model = build_model(preset("tiny"))
    opt = stepped(model)
    t = plan_memory(cfg, gpu_memory=None, device="cpu").phase("optimizer").terms
    assert t["reference_model"] == nbytes(model.parameters())
    assert "policy_masters_fp32" not in t and not opt.has_master  # fp32 weights are their own masters
    assert "master_grads_fp32" not in t


def test_sharded_terms_are_one_nth():
    one = make_plan(run_cfg(), world_size=1, device="cuda").phase("optimizer").terms
    four_plan = make_plan(run_cfg(), world_size=4, device="cuda")
    four = four_plan.phase("optimizer").terms
    # A full replica on every rank while it generates (released for the training and optimizer phases).
    assert four_plan.phase("generation").terms["engine_replica"] == one["policy_weights"]
    assert "engine_replica" not in four
    assert four["policy_shards"] == -(-one["policy_masters_fp32"] // 4)  # fp32 shards are the masters
    assert four["policy_adamw_moments"] == -(-one["policy_adamw_moments"] // 4)
    assert four["policy_grad_shards"] == -(-one["policy_masters_fp32"] // 4)


@pytest.mark.parametrize("n", [2, 3])
def test_offloaded_moment_shards_are_pinned_per_rank(n):
    """Under FSDP2 offload pins each rank's moment shards: rank 0 holds the first torch.chunk of every parameter
    along dim 0 (the largest), two fp32 buffers each, rounded by the pinned allocator (3 ranks: rows that do not
    divide evenly)."""
    cfg = run_cfg("train.offload=optimizer")
    plan = plan_memory(cfg, world_size=n, device="cuda")
    model = build_model(preset("tiny"), dtype=torch.bfloat16)
    shards = [torch.chunk(p.detach(), n, dim=0)[0] for p in model.parameters()]
    assert plan.host_pinned == sum(2 * pinned_bytes(s.numel() * 4) for s in shards)
    assert plan.host_ranks == n and plan_memory(cfg, world_size=n, device="cpu").host_pinned == 0


# ----------------------------------------------------------------------------------------------------------
# Refusal, suggestions, the 30B-A3B plan
# ----------------------------------------------------------------------------------------------------------


def test_a_config_that_cannot_fit_is_refused_with_knobs_that_fit():
    cfg = run_cfg("model.preset=qwen3-1.7b", "task.max_prompt_tokens=256", "sampling.max_tokens=768")
    plan = make_plan(cfg, gpu_memory=40 * GiB, device="cuda")
    assert not plan.fits
    msg = plan.refusal()
    assert f"the {plan.worst.name} phase needs" in msg and str(plan.available) in msg
    assert plan.suggestions, msg
    for knob in ("train.activation_checkpointing", "train.max_tokens_per_microbatch", "lora.rank", "--nproc"):
        assert knob in msg, (knob, msg)
    # Every suggestion, applied, gives a plan that fits.
    applied = {
        'train.offload="optimizer"': ["train.offload=optimizer"],
        "train.activation_checkpointing=true": ["train.activation_checkpointing=true"],
        "train.cuda_graphs=false": ["train.cuda_graphs=false"],
    }
    for s in plan.suggestions:
        label = s.split(" (peak")[0]
        sets = applied.get(label, [label] if label.startswith("train.max_tokens") else None)
        if sets is None:
            continue
        assert make_plan(apply_overrides(cfg, sets), gpu_memory=40 * GiB).fits, s
    # Enough memory: no refusal.
    assert make_plan(cfg, gpu_memory=80 * GiB).fits


def test_an_8b_full_fine_tune_is_offered_the_one_gpu_settings_that_fit():
    """qwen3-8b at the quickstart's fp32 on one 80 GB GPU: LoRA and more ranks fit alone, and the plan also names
    the full fine-tune on this GPU (16-bit weights, optimizer offload, activation checkpointing: the setting
    measured on an H100, docs/memory.md) when the host can pin the offloaded state, and not when it cannot."""
    cfg = load_config(str(Path(__file__).parents[2] / "configs/quickstart.toml"), ["model.preset=qwen3-8b"])
    assert cfg.model.dtype == "float32"  # the README's `exactrl plan` line
    plan = make_plan(cfg, gpu_memory=80 * GiB, device="cuda", host_memory=125 * GiB)
    assert not plan.fits
    together = [s for s in plan.suggestions if s.endswith(")") and " together (peak" in s]
    assert len(together) == 1, plan.suggestions
    sets = together[0].split(" together")[0].split()
    wanted = {"model.dtype=bfloat16", "train.offload=optimizer", "train.activation_checkpointing=true"}
    assert wanted <= set(sets)
    assert "engine.release_memory=true" not in sets  # already the default: not a change to ask for
    fixed = make_plan(apply_overrides(cfg, sets), gpu_memory=80 * GiB, device="cuda", host_memory=125 * GiB)
    assert fixed.fits and fixed.host_fits
    # A host that cannot pin 91.5 GiB: the combination is not offered.
    small = make_plan(cfg, gpu_memory=80 * GiB, device="cuda", host_memory=64 * GiB)
    assert not any(" together (peak" in s for s in small.suggestions), small.suggestions


def test_a_disaggregated_trainer_plans_no_kv_cache_and_grows_its_microbatch_one_step_off():
    """A trainer of a disaggregated run (distributed.generator_ranks > 0) holds no KV cache and no decode graphs
    (its generators do), so one step off, where a colocated rank keeps its cache and its configured microbatch, it
    still takes the larger FSDP2 microbatch (measured on 2 x H200: the 4,096-token microbatch made the lone
    trainer's update 3.2x slower than the grown one)."""
    cfg = run_cfg(
        "model.preset=qwen3-1.7b", "task.max_prompt_tokens=512", "sampling.max_tokens=512",
        "algorithm.max_off_policy_steps=1",
    )  # fmt: skip
    gpu = int(139 * GiB)
    colocated = make_plan(cfg, world_size=1, gpu_memory=gpu, device="cuda", sharded=True)
    disagg = make_plan(
        apply_overrides(copy.deepcopy(cfg), ["distributed.generator_ranks=1"]),
        world_size=1, gpu_memory=gpu, device="cuda", sharded=True,
    )  # fmt: skip
    assert colocated.fits and disagg.fits
    # One step off keeps it in every phase (but the set-up, before any engine).
    assert all(p.terms["kv_cache"] > 0 for p in colocated.phases if p.name != "setup")
    assert all(p.terms.get("kv_cache", 0) == 0 for p in disagg.phases)
    assert all("decode_graph_pool" not in p.terms for p in disagg.phases)
    assert "decode_graph_pool" in colocated.phase("training").terms
    assert colocated.counts["tokens_per_microbatch"] == cfg.train.max_tokens_per_microbatch
    assert disagg.counts["tokens_per_microbatch"] == 32768
    # The engine replica stays (the generators' weights come from it), and one step off the guard's copy of the
    # weights that sampled the batch (the replica moves on before the guard runs).
    steady = [p for p in disagg.phases if p.name != "setup"]
    assert all("engine_replica" in p.terms for p in steady)
    assert all(p.terms["guard_copy"] == disagg.counts["policy_params"] * 2 for p in steady)
    assert all("guard_copy" not in p.terms for p in colocated.phases)


def test_fsdp2_microbatch_grows_to_the_largest_that_fits():
    """Under FSDP2 on a GPU the plan picks the largest of 32768 / 16384 tokens per microbatch whose training phase
    fits (fewer rounds of per-layer collectives), and the configured size when neither does; a set
    train.fsdp_tokens_per_microbatch, one device, the CPU or the release off leave the configured size."""
    cfg = run_cfg("model.preset=qwen3-0.6b", "task.max_prompt_tokens=512", "sampling.max_tokens=512")
    ws = 8

    def training_peak(tokens: int) -> int:
        c = apply_overrides(cfg, [f"train.fsdp_tokens_per_microbatch={tokens}"])
        return plan_memory(c, world_size=ws, device="cuda").phase("training").peak

    p32, p16, p8 = training_peak(32768), training_peak(16384), training_peak(8192)
    assert p32 > p16 > p8  # the activations grow with the microbatch
    ctx = 1 * GiB  # the plan's CUDA context

    def chosen(gpu: int, c=cfg, world_size: int = ws, device: str = "cuda") -> int:
        plan = make_plan(c, world_size=world_size, gpu_memory=gpu, device=device)
        assert plan.fits
        return plan.counts["tokens_per_microbatch"]

    room = lambda peak: int(peak / 0.9) + ctx  # noqa: E731 (a device the plan's 10% headroom leaves it on)
    assert chosen(room(p32) + GiB) == 32768
    assert chosen(p32 + ctx + GiB) == 16384  # fits, but without the headroom an automatic choice keeps
    between = (room(p16) + room(p32)) // 2
    assert chosen(between) == 16384
    assert chosen((room(p8) + room(p16)) // 2) == 8192
    # The chosen plan is the one whose training phase it predicts.
    assert make_plan(cfg, world_size=ws, gpu_memory=between, device="cuda").phase("training").peak == p16
    # Set by the user, or not a sharded GPU run, or the release off: no growth.
    roomy = room(p32) + GiB  # where the automatic choice takes 32768 (above)
    assert chosen(roomy, apply_overrides(cfg, ["train.fsdp_tokens_per_microbatch=8192"])) == 8192
    assert chosen(roomy, world_size=1) == 8192
    assert make_plan(cfg, world_size=ws, device="cpu").counts["tokens_per_microbatch"] == 8192
    kept = apply_overrides(cfg, ["engine.release_memory=false"])
    assert chosen(roomy + 40 * GiB, kept) == 8192
    # A set budget that does not fit: the refusal suggests a smaller one of that key.
    big = apply_overrides(cfg, ["train.fsdp_tokens_per_microbatch=32768"])
    tight = make_plan(big, world_size=ws, gpu_memory=between, device="cuda")
    assert not tight.fits
    assert tight.suggestions[0].startswith("train.fsdp_tokens_per_microbatch=16384"), tight.suggestions
    # A set budget shorter than one full sequence is refused by name.
    with pytest.raises(ValueError, match="train.fsdp_tokens_per_microbatch"):
        run_cfg(
            "task.max_prompt_tokens=512", "sampling.max_tokens=512", "train.fsdp_tokens_per_microbatch=1000"
        )


# ----------------------------------------------------------------------------------------------------------
# FSDP2 at one rank (`exactrl train --nproc 1`): planned as it runs, sharded
# ----------------------------------------------------------------------------------------------------------


def qwen3_06b(*more: str):
    """The quickstart on qwen3-0.6b in bf16 (max_tokens_per_microbatch 4096, engine.release_memory on)."""
    sets = ["model.preset=qwen3-0.6b", "model.dtype=bfloat16", *more]
    return load_config(ROOT / "configs" / "quickstart.toml", sets)


def test_fsdp2_at_one_rank_takes_the_larger_microbatch(monkeypatch):
    """torchrun at one rank trains under FSDP2, host-bound per microbatch like world size 2: with the sharded plan
    it takes the larger microbatch where it fits; the unsharded default (no torchrun) keeps the configured one.
    `exactrl train`'s check (an 80 GB device mocked: no GPU here) passes the choice on."""
    cfg = qwen3_06b()
    configured = cfg.train.max_tokens_per_microbatch
    assert cfg.engine.release_memory and cfg.train.fsdp_tokens_per_microbatch is None
    one_rank = make_plan(cfg, world_size=1, sharded=True, gpu_memory=80 * GiB, device="cuda")
    assert one_rank.fits and one_rank.sharded
    assert one_rank.counts["tokens_per_microbatch"] == 32768 > configured
    # Exactly the choice of world size 2 (its shards halve the state, not the activations that set the choice).
    two = make_plan(cfg, world_size=2, gpu_memory=80 * GiB, device="cuda")
    assert two.counts["tokens_per_microbatch"] == one_rank.counts["tokens_per_microbatch"]
    for sharded in (None, False):
        plan = make_plan(cfg, world_size=1, sharded=sharded, gpu_memory=80 * GiB, device="cuda")
        assert not plan.sharded and plan.counts["tokens_per_microbatch"] == configured

    class Props:
        total_memory = 80 * GiB

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props)
    quiet = lambda *a: None  # noqa: E731
    checked = check_before_loading(cfg, "cuda:0", 1, out=quiet, sharded=True)
    assert checked is not None and checked.counts["tokens_per_microbatch"] == 32768
    assert check_before_loading(cfg, "cuda:0", 1, out=quiet).counts["tokens_per_microbatch"] == configured
    # More than one rank is always FSDP2: an unsharded plan of two ranks is refused by name.
    with pytest.raises(ValueError, match="sharded=False at world size 2"):
        make_plan(cfg, world_size=2, sharded=False, gpu_memory=80 * GiB, device="cuda")


def test_a_set_fsdp_budget_is_honoured_at_one_rank():
    """train.fsdp_tokens_per_microbatch under torchrun at one rank is the trainer's budget, no longer silently
    ignored; without torchrun (sharded False or unset) max_tokens_per_microbatch stays the budget."""
    cfg = qwen3_06b("train.fsdp_tokens_per_microbatch=16384")
    assert microbatch_tokens(cfg, 1, sharded=True) == 16384
    assert microbatch_tokens(cfg, 1, sharded=False) == microbatch_tokens(cfg, 1) == 4096
    sharded = make_plan(cfg, world_size=1, sharded=True, gpu_memory=80 * GiB, device="cuda")
    assert sharded.counts["tokens_per_microbatch"] == 16384  # set: honoured, not grown to 32768
    single = make_plan(cfg, world_size=1, sharded=False, gpu_memory=80 * GiB, device="cuda")
    assert single.counts["tokens_per_microbatch"] == 4096
    # A set budget that does not fit one rank: the refusal offers a smaller one of that key.
    big = qwen3_06b("train.fsdp_tokens_per_microbatch=65536")
    tight = make_plan(big, world_size=1, sharded=True, gpu_memory=40 * GiB, device="cuda")
    assert not tight.fits
    assert tight.suggestions[0].startswith("train.fsdp_tokens_per_microbatch="), tight.suggestions
    assert "(FSDP2)" in tight.refusal()


def test_the_sharded_plan_at_one_rank_has_the_fsdp2_terms():
    """One FSDP2 rank holds what a rank of two does, unsplit: fp32 shards (the masters), a replica for the engine
    (released for training), fp32 gradient shards and the gathered layers; no training graphs."""
    one = make_plan(run_cfg(), world_size=1, device="cuda")
    fsdp = make_plan(run_cfg(), world_size=1, sharded=True, device="cuda")
    two = make_plan(run_cfg(), world_size=2, device="cuda")
    single = {k for p in one.phases for k in p.terms}
    assert {"policy_weights", "policy_grads", "policy_masters_fp32", "train_graph_pool"} <= single
    assert not {"engine_replica", "policy_shards", "policy_grad_shards", "fsdp_unsharded_layers"} & single
    # The same terms as world size 2, phase by phase.
    for name in ("generation", "training", "optimizer"):
        assert set(fsdp.phase(name).terms) == set(two.phase(name).terms), name
    s_one, o_one = fsdp.phase("optimizer").terms, one.phase("optimizer").terms
    assert fsdp.phase("generation").terms["engine_replica"] == o_one["policy_weights"]
    assert s_one["policy_shards"] == o_one["policy_masters_fp32"] == s_one["policy_grad_shards"]
    assert s_one["policy_adamw_moments"] == o_one["policy_adamw_moments"]
    assert "fsdp_unsharded_layers" in fsdp.phase("training").terms and not fsdp.counts["train_graphs"]
    assert fsdp.to_json()["sharded"] is True and one.to_json()["sharded"] is False


def test_train_at_one_torchrun_rank_plans_sharded(monkeypatch, tmp_path):
    """RLRun under torchrun at world size 1 (a real one-rank gloo group, the CPU) asks the plan and the budget for
    FSDP2's: sharded=True reaches check_before_loading, and the set train.fsdp_tokens_per_microbatch is taken."""
    import torch.distributed as dist

    import exactrl.train.loop as loop

    class Stop(Exception):
        pass

    seen: dict = {}
    real_microbatch = loop.microbatch_tokens

    def check(cfg, device, world_size, out=print, **kw):
        seen["check"] = (world_size, kw.get("sharded"))
        return None  # the CPU's answer: no plan, the budget from microbatch_tokens

    def budget(cfg, world_size, **kw):
        seen["budget"] = real_microbatch(cfg, world_size, **kw)
        return seen["budget"]

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(loop, "check_before_loading", check)
    monkeypatch.setattr(loop, "microbatch_tokens", budget)
    monkeypatch.setattr(loop, "MemoryPhases", stop)  # the next stage: enough has been decided
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", "0")
    cfg = run_cfg(
        "run.device=cpu", f"run.output_dir={tmp_path / 'run'}", "train.fsdp_tokens_per_microbatch=2048"
    )
    try:
        with pytest.raises(Stop):
            loop.RLRun(cfg, out=lambda *a, **k: None)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert seen == {"check": (1, True), "budget": 2048}


def test_train_refuses_before_loading(monkeypatch):
    """The check `exactrl train` runs first, with a CUDA device's total memory mocked (no GPU here)."""

    class Props:
        total_memory = 30 * GiB

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props)
    cfg = run_cfg("model.preset=qwen3-1.7b")
    with pytest.raises(MemoryPlanError, match="lora.rank=16"):
        check_before_loading(cfg, "cuda:0", 1, out=lambda *a: None)
    assert check_before_loading(cfg, "cpu", 1) is None  # no device limit on the CPU
    # check_memory = false: no refusal, the plan still sizes the KV cache.
    unchecked = check_before_loading(apply_overrides(cfg, ["train.check_memory=false"]), "cuda:0", 1)
    assert unchecked is not None and not unchecked.fits and unchecked.counts["kv_blocks"] >= 2


def test_qwen3_30b_a3b_on_8_x_80gb_follows_the_formula():
    cfg = run_cfg("model.preset=qwen3-30b-a3b")
    m = preset("qwen3-30b-a3b")
    plan = make_plan(cfg, world_size=8, gpu_memory=80 * GiB)
    p = m.num_params()  # the closed formula of exactrl.model.config, not the meta model's count
    assert p == plan.counts["policy_params"]
    t = plan.phase("training").terms
    # The replica generates, and is released while the trainer trains (engine.release_memory).
    assert plan.phase("generation").terms["engine_replica"] == 2 * p and "engine_replica" not in t
    assert t["policy_shards"] == -(-4 * p // 8)
    assert t["policy_adamw_moments"] == -(-8 * p // 8)
    assert t["policy_grad_shards"] == -(-4 * p // 8)
    # One sparse layer's saved bytes per token, written out: norms' inputs 4D, q|k|v, q and k roped, attention
    # output (bf16); 2 rstd, per-head lse and q/k-norm rstd (fp32); router probabilities (fp32), top-k ids and
    # weights, per routed row gate|up and output (bf16) and its token and slot index.
    D, Q, KV, H, HKV, E, K, W = 2048, 32 * 128, 4 * 128, 32, 4, 128, 8, 768
    per_token = (4 * D + (Q + 2 * KV) + Q + KV + Q) * 2 + 8 + H * 4 + (H + HKV) * 4
    per_token += E * 4 + K * 12 + K * ((2 * W + D) * 2 + 16)
    assert activation_bytes_per_token(m, 2, 0) == per_token
    tokens = cfg.train.max_tokens_per_microbatch
    assert t["activations"] == 48 * per_token * tokens + 2 * D * 2 * tokens + 64 * tokens
    # 8 x 80 GB does not hold a 30B-A3B full fine-tune today (the arithmetic: replica + state shards).
    assert not plan.fits and plan.worst.name == "training"


def test_qwen3_30b_a3b_on_8_x_80gb_fits_with_the_moment_shards_offloaded():
    """The plan of docs/memory.md (bf16, 128 rollouts of up to 512 tokens, an 80 GB H100's 79.18 GiB): without
    offload the generation phase holds replica + fp32 shards + moment shards and does not fit; with
    train.offload = "optimizer" the moment shards are on the device only for the optimizer step, and each rank pins
    two host buffers per parameter shard (rank 0's, the largest: torch.chunk along dim 0)."""
    sets = [
        "model.preset=qwen3-30b-a3b",
        "model.dtype=bfloat16",
        "run.device=cuda",
        "algorithm.rollouts_per_step=128",
        "engine.max_model_len=1024",
        "sampling.max_tokens=512",
        "train.fsdp_reduce=microbatch",
    ]
    quickstart = lambda *more: load_config(ROOT / "configs" / "quickstart.toml", [*sets, *more])  # noqa: E731
    gpu, host = int(79.18 * GiB), 1024 * GiB
    # One reduce-scatter per minibatch: every rank accumulates the whole model's fp32 gradients unsharded
    # until the minibatch's last microbatch, 4 bytes a parameter (a 2 x H200 rank ran out of memory there).
    whole = make_plan(
        quickstart("train.offload=optimizer", "train.fsdp_reduce=minibatch"), world_size=8, gpu_memory=gpu
    )
    assert whole.phase("training").terms["fsdp_accumulated_grads"] == 4 * preset("qwen3-30b-a3b").num_params()
    assert not whole.fits and 'train.fsdp_reduce="microbatch"' in whole.refusal()
    off = make_plan(quickstart(), world_size=8, gpu_memory=gpu, host_memory=host)
    assert not off.fits and off.worst.name == "generation"
    assert 'train.offload="optimizer"' in off.refusal()
    plan = make_plan(quickstart("train.offload=optimizer"), world_size=8, gpu_memory=gpu, host_memory=host)
    p = preset("qwen3-30b-a3b").num_params()
    gen, train_, step = (plan.phase(n).terms for n in ("generation", "training", "optimizer"))
    assert gen["engine_replica"] == 2 * p and gen["policy_shards"] == -(-4 * p // 8)
    for t in (gen, train_):
        assert "policy_adamw_moments" not in t
    # The optimizer step streams the moment shards through the device a group at a time (groups of 1 GiB of
    # shards at 12 bytes an element, MasterAdamW's): the largest group's two fp32 moments, not all of them.
    with torch.device("meta"):
        model = CausalLM(preset("qwen3-30b-a3b"))
    numels = [torch.chunk(q, 8, dim=0)[0].numel() for q in model.parameters()]
    group = max(8 * sum(numels[i] for i in g) for g in offload_chunks(numels, 12, OFFLOAD_CHUNK_BYTES))
    assert "policy_adamw_moments" not in step and step["optimizer_state_chunk"] == group
    assert group < off.phase("generation").terms["policy_adamw_moments"] // 20
    assert step["policy_grad_shards"] == -(-4 * p // 8)
    # Each phase is the plan without offload less the moments where they are not held (the KV cache, sized from
    # what generation leaves, grows into the room); the optimizer phase holds one group of them.
    for name in ("training", "optimizer"):
        o = off.phase(name).terms
        assert plan.phase(name).peak == sum(o.values()) - o["policy_adamw_moments"] + (
            group if name == "optimizer" else 0
        )
    assert gen["kv_cache"] >= off.phase("generation").terms["kv_cache"]
    assert plan.fits and plan.worst.name == "generation"
    assert 70 * GiB < plan.peak <= plan.available
    # Host: per rank, two pinned buffers per trained tensor's rank-0 shard, each its exact size (pinned_bytes).
    shard = [n * 4 for n in numels]
    assert plan.host_pinned == sum(2 * pinned_bytes(b) for b in shard)
    assert sum(shard) * 2 <= plan.host_pinned < sum(shard) * 4
    assert plan.host_ranks == 8 and plan.host_fits
    assert "host memory per rank" in plan.table() and "8 ranks on one host" in plan.table()


def test_plan_command_prints_a_table_and_with_json_one_json_line(capsys):
    from exactrl.cli import main

    argv = ["plan", str(ROOT / "configs" / "quickstart.toml"), "--set", "model.preset=qwen3-30b-a3b", "--set",
            "model.dtype=bfloat16", "--nproc", "8", "--gpu-memory", "80"]  # fmt: skip
    assert main(argv) == 1
    human = capsys.readouterr().out.splitlines()
    assert not any(line.startswith("{") for line in human)  # the JSON line only with --json
    rc = main([*argv, "--json"])
    out = capsys.readouterr().out.splitlines()
    assert out[:-1] == human
    assert rc == 1  # does not fit: the exit code says so
    # The quickstart is a CPU config: --gpu-memory plans it on a CUDA device, and says so first.
    assert out[0].startswith('run.device = "cpu" in the config: planned for a CUDA device of 80 GiB')
    assert out[1].startswith("bytes per rank (GiB)") and "generation" in out[1]
    j = json.loads(out[-1])["memory_plan"]
    assert j["world_size"] == 8 and j["fits"] is False
    assert set(j["phases"]) == {"setup", "generation", "training", "optimizer"}


def test_plan_command_nproc_1_is_one_fsdp2_rank(capsys):
    """`exactrl plan --nproc 1` plans what `exactrl train --nproc 1` runs (one FSDP2 rank: sharded, the larger
    microbatch); without --nproc, one device without torchrun."""
    from exactrl.cli import main

    base = ["plan", str(ROOT / "configs" / "quickstart.toml"), "--set", "model.preset=qwen3-0.6b"]
    base += ["--set", "model.dtype=bfloat16", "--gpu-memory", "80", "--json"]
    plans = {}
    for extra in ([], ["--nproc", "1"]):
        assert main(base + extra) == 0
        plans[tuple(extra)] = json.loads(capsys.readouterr().out.splitlines()[-1])["memory_plan"]
    single, fsdp = plans[()], plans[("--nproc", "1")]
    assert single["world_size"] == fsdp["world_size"] == 1
    assert single["sharded"] is False and fsdp["sharded"] is True
    assert single["counts"]["tokens_per_microbatch"] == 4096
    assert fsdp["counts"]["tokens_per_microbatch"] == 32768
    assert "engine_replica" in fsdp["phases"]["generation"]
    assert "engine_replica" not in single["phases"]["generation"]


# ----------------------------------------------------------------------------------------------------------
# Offload: the state moves, the bits do not change
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [1 << 30, 200_000], ids=["one-group", "streamed"])
def test_offload_moves_the_state_and_keeps_the_bits(monkeypatch, chunk_bytes):
    """Offload on vs off over steps that clip, and one skipped (a non-finite gradient): the same weights, masters
    and moments bit for bit; the step reads its state from buffers other than the host ones; in several groups
    when the state is over offload_chunk_bytes, each master stepped once per step."""
    base = build_model(preset("tiny"), dtype=torch.bfloat16)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    kw = dict(lr=1e-3, weight_decay=0.1)
    on = MasterAdamW(a, offload="optimizer", offload_chunk_bytes=chunk_bytes, **kw)
    off = MasterAdamW(b, **kw)
    assert (len(on._chunks) == 1) if chunk_bytes > 1 << 20 else (len(on._chunks) > 10)
    host_ptrs = lambda: {t.data_ptr() for t in on._host.values()}  # noqa: E731
    # Per opt.step call: the data of the masters it steps and of their moments.
    stepped_ptrs: list[list[int]] = []
    stepped_ids: list[int] = []
    real_step = on.opt.step

    def spy():
        ptrs = []
        for i, m in enumerate(on.master):
            if m.grad is not None:
                stepped_ids.append(i)
                st = on.opt.state.get(m, {})
                ptrs += [m.data_ptr()] + [st[k].data_ptr() for k in ("exp_avg", "exp_avg_sq") if k in st]
        # Compared now, with the host buffers of this moment (on the CPU a freed buffer's address may come back
        # as a later host buffer's).
        assert not set(ptrs) & host_ptrs(), "the step read host buffers"
        stepped_ptrs.append(ptrs)
        return real_step()

    monkeypatch.setattr(on.opt, "step", spy)
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        for pa, pb in zip(on.params, off.params):
            pa.grad = (torch.randn(pa.shape, generator=g) * (0.1 if step != 1 else 10.0)).to(pa.dtype)
            if step == 2:
                pa.grad.view(-1)[0] = float("nan")  # skipped: no state may change
            pb.grad = pa.grad.clone()
        assert on.on_host and all(t.data_ptr() == on._host[k].data_ptr() for k, t in on._offloaded())
        stepped_ptrs.clear()
        stepped_ids.clear()
        na, nb = on.clip_and_step(1.0), off.clip_and_step(1.0)
        assert (math.isnan(na) and math.isnan(nb)) or na == nb
        if step != 2:
            assert sorted(stepped_ids) == list(range(len(on.master)))  # every master once
            assert len(stepped_ptrs) == len(on._chunks)
        for pa, pb in zip(a.parameters(), b.parameters()):
            assert torch.equal(pa, pb)
        for ma, mb in zip(on.master, off.master):
            assert torch.equal(ma, mb)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(on.opt.state[ma][k], off.opt.state[mb][k])
    assert len(on._host) == 3 * len(on.master)  # masters and both moments, one buffer each, reused
    assert on.offloaded_bytes() == 12 * sum(p.numel() for p in on.params)
    # A checkpoint round trip with offload on puts the state back in the host buffers, same values.
    state = on.state_dict()
    again = MasterAdamW(copy.deepcopy(base), offload="optimizer", offload_chunk_bytes=chunk_bytes, **kw)
    again.load_state_dict(state)
    assert again.on_host and all(t.data_ptr() == again._host[k].data_ptr() for k, t in again._offloaded())
    for ma, mb in zip(again.master, off.master):
        assert torch.equal(ma, mb)
        assert torch.equal(again.opt.state[ma]["exp_avg_sq"], off.opt.state[mb]["exp_avg_sq"])


def test_offload_modes_are_named():
    with pytest.raises(ValueError, match="offload must be one of"):
        MasterAdamW(build_model(preset("tiny")), lr=1e-3, offload="all")


# A whole RL run with offload on against one with it off: the same metrics and bits, and a planted host-buffer
# bug (the moments rounded to bf16 while they wait) shows the comparison can fail.
PLUGIN = "exactrl_test_plan_rewards"
PLUGIN_SOURCE = """
import hashlib


def hashed(completion, answer, example):
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    d = tmp_path_factory.mktemp("plugin")
    (d / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
    sys.path.insert(0, str(d))
    importlib.invalidate_caches()
    yield importlib.import_module(PLUGIN)
    sys.path.remove(str(d))
    sys.modules.pop(PLUGIN, None)


def rl_cfg(out: Path, *overrides: str):
    base = {
        "run": {
            "seed": 0,
            "device": "cpu",
            "tensorboard": False,
            "report": False,
            "progress": False,
            "output_dir": str(out),
        },
        "model": {"preset": "tiny", "dtype": "bfloat16"},
        "engine": {"max_model_len": 64},
        "sampling": {"max_tokens": 4},
        "task": {"use_chat_template": False, "num_eval": 4, "eval_every": 0, "max_prompt_tokens": 16},
        "reward": {"functions": [f"{PLUGIN}:hashed"]},
        "algorithm": {"group_size": 4, "rollouts_per_step": 16, "kl_coef": 0.05},
        "train": {"steps": 2, "lr": 3e-4, "max_tokens_per_microbatch": 1024},
    }
    cfg = apply_overrides(config_from_dict(base), list(overrides))
    cfg.validate()
    return cfg


def run_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    keep = lambda k: not (k.startswith("perf/") or k.endswith("_s") or "tokens_per_s" in k or k == "minutes")  # noqa: E731
    return [{k: v for k, v in json.loads(x).items() if keep(k)} for x in lines]


def run_weights(out: Path) -> dict[str, torch.Tensor]:
    root = out / "checkpoints"
    return load_file(str(root / (root / "latest").read_text().strip() / "policy" / "model.safetensors"))


def same_run(a: Path, b: Path) -> bool:
    wa, wb = run_weights(a), run_weights(b)
    return run_records(a) == run_records(b) and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_rl_run_with_offload_is_bitwise_the_same(plugin, tmp_path, monkeypatch):
    from exactrl.train.loop import train

    torch.set_num_threads(1)
    quiet = lambda *a, **k: None  # noqa: E731
    train(rl_cfg(tmp_path / "off"), out=quiet)
    train(rl_cfg(tmp_path / "on", "train.offload=optimizer"), out=quiet)
    assert same_run(tmp_path / "off", tmp_path / "on")
    # Negative control: host buffers that round the moments to bf16 change the run.
    real = MasterAdamW.to_host

    def lossy(self, idx=None):
        real(self, idx)
        for key, t in self._offloaded(idx):
            if key[1] != "master":
                t.copy_(t.bfloat16().float())

    monkeypatch.setattr(MasterAdamW, "to_host", lossy)
    train(rl_cfg(tmp_path / "bad", "train.offload=optimizer"), out=quiet)
    assert not same_run(tmp_path / "off", tmp_path / "bad")


def test_multi_turn_with_the_episode_cap_unset_and_one_step_off_are_planned():
    """env.max_episode_tokens unset (= the engine's limit) once crashed the plan, and with it every CUDA train of a
    multi-turn run; one step off holds the engine's own weight copy beside the trainer's."""
    env = make_plan(run_cfg("env.name=guess", "engine.max_model_len=512"), gpu_memory=80 * GiB, device="cuda")
    capped = make_plan(
        run_cfg("env.name=guess", "engine.max_model_len=512", "env.max_episode_tokens=512"),
        gpu_memory=80 * GiB,
        device="cuda",
    )
    assert env.phase("generation").terms["kv_cache"] == capped.phase("generation").terms["kv_cache"]
    sync = make_plan(run_cfg(), gpu_memory=80 * GiB, device="cuda").phase("training").terms
    off = make_plan(run_cfg("algorithm.max_off_policy_steps=1"), gpu_memory=80 * GiB, device="cuda")
    terms = off.phase("training").terms
    assert "behaviour_copy" not in sync and terms["behaviour_copy"] == sync["policy_weights"]


def test_the_set_up_is_planned_whole_before_fsdp2_shards():
    """Before FSDP2 shards anything a rank holds the policy whole in the model dtype, a KL reference's whole
    copy, and one layer cast to fp32 (the engine replica is structure alone until then): a card that holds the
    steady phases but not the set-up is refused by its "setup" phase."""
    shape = ("model.preset=qwen3-8b", "train.fsdp_tokens_per_microbatch=2048", "train.fsdp_reduce=microbatch")
    plan = make_plan(run_cfg(*shape), world_size=8, device="cuda")
    setup, p = plan.phase("setup").terms, plan.counts["policy_params"]
    assert setup["policy_whole"] == 2 * p and "reference_whole" not in setup
    assert setup["fsdp_cast_layer_fp32"] == 4 * plan.counts["largest_layer_params"]
    assert not any(k.startswith("engine") for k in setup)
    kl = make_plan(run_cfg(*shape, "algorithm.kl_coef=0.05"), world_size=8, device="cuda")
    assert kl.phase("setup").terms["reference_whole"] == 2 * p
    # A card between the steady phases and the set-up with the reference: refused by the set-up alone.
    steady = max(ph.peak for ph in kl.phases if ph.name != "setup")
    setup_peak = kl.phase("setup").peak
    assert setup_peak > steady
    card = int((steady + setup_peak) / 2 + CUDA_CONTEXT_BYTES)
    refused = make_plan(
        run_cfg(*shape, "algorithm.kl_coef=0.05"), world_size=8, gpu_memory=card, device="cuda"
    )
    assert not refused.fits and refused.worst.name == "setup"
    # The control: without the reference the same card holds it.
    assert make_plan(run_cfg(*shape), world_size=8, gpu_memory=card, device="cuda").fits
