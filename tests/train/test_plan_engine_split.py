"""The memory plan of an engine shared by a group of ranks (`engine.tensor_parallel = T`,
`engine.expert_parallel = E`, exactrl/train/memory.py): each rank's engine shard and KV cache.

What a CPU shows: the plan's per-rank replica bytes equal the bytes of the shards the real split code keeps
(`shard_engine_model`, `shard_experts`, built in one process for each rank of a group, no collective needed to
build them), and its KV bytes per token the engine runner's own count on that shard, for a dense model (KV heads
split), one with fewer KV heads than ranks (a copy per rank), a vocabulary T does not divide, a Qwen2-MoE (shared
expert split, routed experts replicated or split); qwen3-30b-a3b at --nproc 2 with T = E = 2 by the formula
written out (docs/memory.md); the suggestions name a split that fits; `exactrl plan` refuses what train refuses.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import exactrl.train.memory as memory
from exactrl.config import apply_overrides
from exactrl.distributed.expert_parallel import shard_experts
from exactrl.distributed.tensor_parallel import TensorParallelGroup, shard_engine_model
from exactrl.engine.runner import kv_bytes_per_token
from exactrl.model.config import preset
from exactrl.model.qwen import build_model
from exactrl.train.memory import GiB, plan_memory
from exactrl.train.memory_fit import make_plan

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_plan import run_cfg  # noqa: E402  (the tiny bf16 config the plan tests share)


def shard_bytes(mcfg, t: int, e: int, rank: int) -> tuple[int, int]:
    """(bytes of the parameters, KV bytes per token) of rank `rank`'s engine shard, split by the real code."""
    model = build_model(mcfg, dtype=torch.bfloat16)
    group = TensorParallelGroup(max(t, e), rank)
    if t > 1:
        model = shard_engine_model(model, group)
    if e > 1:
        model = shard_experts(model, group)
    held = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}  # a tied weight once
    return sum(held.values()), kv_bytes_per_token(model)


@pytest.mark.parametrize(
    "name, t, e",
    [
        ("tiny", 2, 1),  # 2 KV heads: one per rank
        (
            "tiny",
            4,
            1,
        ),  # fewer KV heads than ranks: a copy of one KV head on each (1/2 of the cache, not 1/4)
        ("tiny-qwen2-moe", 2, 1),  # q/k/v biases, the shared expert split, routed experts whole
        ("tiny-qwen2-moe", 1, 2),  # routed experts 1/E, the rest whole
        ("tiny-qwen2-moe", 2, 2),
        ("tiny-moe", 2, 2),
    ],
)
def test_replica_and_kv_per_rank_equal_the_real_shards(name, t, e):
    cfg = run_cfg(f"model.preset={name}", f"engine.tensor_parallel={t}", f"engine.expert_parallel={e}")
    g = max(t, e)
    plan = plan_memory(cfg, world_size=g, device="cpu", sharded=True)
    mcfg = preset(name)
    for rank in range(g):
        weights, kv = shard_bytes(mcfg, t, e, rank)
        assert plan.phase("generation").terms["engine_replica"] == weights, rank
        assert plan.counts["kv_bytes_per_token"] == kv, rank
    blocks = plan.counts["kv_blocks"]
    assert plan.phase("generation").terms["kv_cache"] == (blocks + 1) * kv * cfg.engine.block_size
    # And the split holds less than the whole replica (what the plan counted before).
    whole = plan_memory(run_cfg(f"model.preset={name}"), world_size=g, device="cpu", sharded=True)
    assert weights < whole.phase("generation").terms["engine_replica"]


def test_a_vocabulary_t_does_not_divide_is_padded(monkeypatch):
    mcfg = dataclasses.replace(preset("tiny"), vocab_size=509, tie_word_embeddings=False)
    monkeypatch.setattr(memory, "model_config", lambda cfg: mcfg)
    monkeypatch.setattr(memory, "_SHARDS", {})
    cfg = run_cfg("engine.tensor_parallel=2")
    plan = plan_memory(cfg, world_size=2, device="cpu", sharded=True)
    for rank in range(2):  # rank 1 holds 254 rows and a zero row of padding: 255 each, embedding and LM head
        assert plan.phase("generation").terms["engine_replica"] == shard_bytes(mcfg, 2, 1, rank)[0]


def test_a_shared_engine_samples_its_group_s_prompts():
    """The KV cap is the union of the group's shares: one engine call for G ranks' prompts."""
    one = plan_memory(run_cfg(), world_size=2, device="cpu", sharded=True)
    two = plan_memory(run_cfg("engine.tensor_parallel=2"), world_size=2, device="cpu", sharded=True)
    assert two.counts["rollout_tokens_needed"] == 2 * one.counts["rollout_tokens_needed"]


def test_qwen3_30b_a3b_at_2_ranks_with_t_e_2_follows_the_formula():
    cfg = run_cfg(
        "model.preset=qwen3-30b-a3b",
        "engine.tensor_parallel=2",
        "engine.expert_parallel=2",
        "train.offload=optimizer",
    )
    m = preset("qwen3-30b-a3b")
    plan = make_plan(cfg, world_size=2, gpu_memory=80 * GiB)
    # One rank's shard, written out: per layer q/k/v of 16 query and 2 of the 4 KV heads (head_dim 128) and
    # half of o_proj's output rows, the q/k norms, both layer norms and the router whole, 64 of the 128 experts;
    # half the vocabulary of the embedding and of the LM head; the final norm.
    D, dh, V = 2048, 128, 151936
    layer = (16 + 2 * 2) * dh * D + (D // 2) * (32 * dh) + 2 * dh + 2 * D + 128 * D
    layer += 64 * (2 * 768 * D + D * 768)
    shard = 48 * layer + 2 * (V // 2) * D + D
    g = plan.phase("generation").terms
    assert g["engine_replica"] == 2 * shard  # bf16
    assert plan.counts["engine_shard_params"] == shard
    assert shard < m.num_params() / 2 + 1e9  # about half: experts and vocabulary dominate
    assert plan.counts["kv_bytes_per_token"] == 48 * 2 * 2 * dh * 2  # 2 KV heads per rank
    # The checkpoint's whole copy on rank 0 (Parallelism.whole_engine_model gathers it on the device).
    ck = plan.phase("checkpoint").terms
    assert ck["whole_engine_rank0"] == 2 * m.num_params() and ck["engine_replica"] == 2 * shard
    # The figures docs/memory.md quotes (GiB per rank).
    assert round(g["engine_replica"] / GiB, 2) == 28.45
    assert round(ck["whole_engine_rank0"] / GiB, 2) == 56.87
    assert not plan.fits  # 2 x 80 GB hold no full fine-tune of it: the trainer's fp32 shards alone are 56.87


def test_the_suggestions_name_a_split_that_fits():
    cfg = run_cfg(
        "model.preset=qwen3-30b-a3b",
        "train.activation_checkpointing=true",
        "train.save_every=0",
        "train.save_at_end=false",
    )
    plan = make_plan(cfg, world_size=8, gpu_memory=80 * GiB)
    assert not plan.fits and plan.worst.name == "generation"
    splits = [s for s in plan.suggestions if s.startswith("engine.")]
    assert len(splits) == 1 and splits[0].startswith("engine.expert_parallel=2 (peak ")
    fixed = make_plan(apply_overrides(cfg, ["engine.expert_parallel=2"]), world_size=8, gpu_memory=80 * GiB)
    assert fixed.fits and "engine_gathers" in fixed.phase("generation").terms


def test_plan_refuses_what_train_refuses(capsys):
    from exactrl.cli import main

    base = [
        "plan",
        str(ROOT / "configs" / "quickstart.toml"),
        "--set",
        "model.preset=tiny",
        "--set",
        "engine.tensor_parallel=2",
    ]

    def refused(*more: str) -> str:
        assert main([*base, *more]) != 0
        c = capsys.readouterr()
        return c.out + c.err

    assert "engine.tensor_parallel = 2 runs on torchrun ranks: pass --nproc N to `exactrl plan`" in refused()
    assert "does not divide the world size 3" in refused("--nproc", "3")
    assert "so it must divide the generator ranks" in refused(
        "--nproc", "3", "--set", "distributed.generator_ranks=1"
    )
    assert "the model has no sparse" in refused("--nproc", "2", "--set", "engine.expert_parallel=2")
    assert main([*base, "--nproc", "2", "--json"]) == 0
    assert '"engine_ranks":2' in capsys.readouterr().out
    # Multi-turn episodes run in lockstep on the group's ranks (exactrl/envs/rollout.py): no longer refused.
    assert main([*base, "--nproc", "2", "--set", "env.name=guess"]) == 0, capsys.readouterr()


def test_a_split_engine_with_lora_holds_its_shard_of_the_frozen_base():
    """LoRA with engine.tensor_parallel = 2: the replica's frozen base is the rank's shard, not the whole model,
    and the adapters are what the weight sync refreshes; without the split the whole base stays."""
    lora = ("model.preset=qwen3-8b", "lora.rank=16")
    split = make_plan(run_cfg(*lora, "engine.tensor_parallel=2"), world_size=2, device="cuda")
    whole = make_plan(run_cfg(*lora), world_size=2, device="cuda")
    shard = memory.engine_shard_params(run_cfg(*lora, "engine.tensor_parallel=2"))
    gen, gen1 = split.phase("generation").terms, whole.phase("generation").terms
    assert gen["engine_replica_frozen"] == 2 * shard
    assert (
        gen1["engine_replica_frozen"]
        == 2 * whole.counts["policy_frozen"]
        > 1.9 * gen["engine_replica_frozen"]
    )
    assert gen["engine_replica"] == gen1["engine_replica"] == 2 * split.counts["policy_trainable"]
