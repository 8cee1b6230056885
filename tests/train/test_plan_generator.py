"""The memory plan of a generator rank (disaggregated: `distributed.generator_ranks = G`, exactrl/train/memory.py
`plan_generator`): the engine's weights shard, the KV cache the engine sizes itself, the decode graphs and working
set, the weight sync's receive buffers.

What a CPU shows: the terms for qwen3-8b at engine.tensor_parallel = 1 and 2 equal the sizes written out by hand
(the split halves q/k/v, o_proj, the MLP and the vocabulary, not the norms; the KV cache per token halves with the
KV heads; the receive buffer is the largest whole tensor, the embedding), expert parallel halves the experts and not
the cache, the cache is the engine's fraction of what the weights leave free or the largest call's need; `exactrl
plan --nproc 3` with one generator prints both plans and refuses a generator that cannot fit, naming the split that
would; a generator rank checks its plan before it makes its model (a mocked CUDA device, no launch).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from exactrl.cli import main
from exactrl.train import disagg
from exactrl.train.memory import CUDA_CONTEXT_BYTES, GiB, MemoryPlanError
from exactrl.train.memory_generator import make_generator_plan, plan_generator

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from test_plan import run_cfg  # noqa: E402  (the tiny bf16 config the plan tests share)

# qwen3-8b's shape (exactrl/model/config.py)
D, NH, NKV, DH, FF, L, V = 4096, 32, 8, 128, 12288, 36, 151936


def qwen3_8b_engine_params(t: int) -> int:
    """One rank's share of qwen3-8b's weights in an engine split over t ranks by tensor parallel: q/k/v of its
    NH / t query and NKV / t KV heads, o_proj and the MLP 1/t, the four norms of a layer whole; the embedding and
    the (untied) LM head V / t rows each; the final norm."""
    layer = (NH // t + 2 * NKV // t) * DH * D + (NH * DH * D) // t + 3 * FF * D // t + 2 * D + 2 * DH
    return L * layer + 2 * (-(-V // t)) * D + D


def generator_cfg(*overrides: str):
    return run_cfg("model.preset=qwen3-8b", *overrides)


def rollout_tokens(cfg, prompts: int) -> int:
    """A call's worst case over `prompts` prompts, as the engine reserves it: each prompt once, n completions,
    a block of slack per completion."""
    n, grow = cfg.algorithm.group_size, min(cfg.sampling.max_tokens, cfg.engine.max_model_len)
    return prompts * (cfg.task.max_prompt_tokens + n * grow + cfg.engine.block_size * n)


def test_the_terms_of_qwen3_8b_at_t_1_and_2_are_the_hand_computed_sizes():
    big = 139 * GiB  # the largest call's need caps the cache
    one = plan_generator(generator_cfg("distributed.generator_ranks=1"), world_size=3, gpu_memory=big)
    two = plan_generator(
        generator_cfg("distributed.generator_ranks=2", "engine.tensor_parallel=2"),
        world_size=4,
        gpu_memory=big,
    )
    assert qwen3_8b_engine_params(1) == 8190735360  # the preset's parameter count
    for plan, t in ((one, 1), (two, 2)):
        kv_per_token = L * 2 * (NKV // t) * DH * 2  # K and V of the rank's KV heads, bf16
        assert plan.counts["kv_bytes_per_token"] == kv_per_token
        gen, first, sync = (plan.phase(n).terms for n in ("generation", "first_sync", "sync"))
        assert gen["engine_weights"] == first["engine_weights"] == 2 * qwen3_8b_engine_params(t)
        # One engine of t ranks serves both trainers: their 2 x 4 prompts in one call.
        need = rollout_tokens(plan_cfg := generator_cfg(), 8)
        assert plan.counts["rollout_tokens_needed"] == need
        blocks = -(-need // plan_cfg.engine.block_size) + 1
        assert plan.counts["kv_blocks"] == blocks
        assert gen["kv_cache"] == sync["kv_cache"] == (blocks + 1) * 16 * kv_per_token
        assert "kv_cache" not in first  # the first sync comes before any generation
        # The decode graphs' fp32 logits, noise and int64 ids of 256 sequences, kept for the run.
        assert gen["decode_graph_pool"] == sync["decode_graph_pool"] == 256 * V * 16
        # recv_weights receives one bucket of whole tensors at a time: the embedding (2.4 GB) is one alone.
        assert first["sync_bucket"] == sync["sync_bucket"] == V * D * 2
    # The split halves everything it splits (not the norms), and the cache per token.
    norms = L * (2 * D + 2 * DH) + D
    assert 2 * (qwen3_8b_engine_params(2) - norms) == qwen3_8b_engine_params(1) - norms
    assert two.counts["kv_bytes_per_token"] * 2 == one.counts["kv_bytes_per_token"]
    # A split rank copies its slice of each whole weight out of the bucket: the largest, half the embedding.
    assert two.phase("first_sync").terms["sync_slice"] == (V // 2) * D * 2
    assert "sync_slice" not in one.phase("first_sync").terms
    assert (
        two.phase("generation").terms["engine_gathers"] > 0
        and "engine_gathers" not in one.phase("generation").terms
    )


def test_the_cache_is_the_engine_s_fraction_of_what_the_weights_and_the_sync_leave():
    """Where the memory, not the call, limits it: generator_kv_memory_fraction of the device less the CUDA context,
    the weights and the first sync's bucket (the allocator keeps it), in whole blocks plus the scratch block."""
    cfg = generator_cfg("distributed.generator_ranks=1")
    gpu = 19 * GiB
    plan = plan_generator(cfg, world_size=3, gpu_memory=gpu)
    free = gpu - CUDA_CONTEXT_BYTES - 2 * qwen3_8b_engine_params(1) - V * D * 2
    per_block = 16 * L * 2 * NKV * DH * 2
    blocks = int(free * 0.85) // per_block
    assert blocks < plan.counts["rollout_tokens_needed"] // 16  # the budget binds, not the need
    assert plan.counts["kv_blocks"] == blocks
    assert plan.phase("generation").terms["kv_cache"] == (blocks + 1) * per_block
    half = plan_generator(
        generator_cfg("distributed.generator_ranks=1", "distributed.generator_kv_memory_fraction=0.5"),
        world_size=3,
        gpu_memory=gpu,
    )
    assert half.counts["kv_blocks"] == int(free * 0.5) // per_block
    fixed = plan_generator(
        generator_cfg("distributed.generator_ranks=1", "engine.num_kv_blocks=100"),
        world_size=3,
        gpu_memory=gpu,
    )
    assert fixed.phase("sync").terms["kv_cache"] == 101 * per_block


def test_more_engines_serve_fewer_trainers_each():
    """Two engines for two trainers: each samples one trainer's prompts, half the largest call."""
    one = plan_generator(generator_cfg("distributed.generator_ranks=1"), world_size=3, device="cpu")
    two = plan_generator(generator_cfg("distributed.generator_ranks=2"), world_size=4, device="cpu")
    assert one.counts["trainers_served"] == 2 and two.counts["trainers_served"] == 1
    assert one.counts["rollout_tokens_needed"] == 2 * two.counts["rollout_tokens_needed"]


def test_expert_parallel_halves_the_experts_not_the_cache():
    def plan(e: int):
        cfg = run_cfg("model.preset=tiny-moe", "distributed.generator_ranks=2", f"engine.expert_parallel={e}")
        return plan_generator(cfg, world_size=4, device="cpu")

    one, two = plan(1), plan(2)
    experts = 3 * 8 * (2 * 64 * 128 + 64 * 128)  # layers 1-3 are sparse: 8 experts' gate|up and down
    w = lambda p: p.phase("generation").terms["engine_weights"]  # noqa: E731
    assert w(one) - w(two) == 2 * experts // 2
    assert one.counts["kv_bytes_per_token"] == two.counts["kv_bytes_per_token"]


def test_lora_holds_the_base_and_the_adapters_and_a_step_syncs_the_adapters():
    cfg = generator_cfg("distributed.generator_ranks=1", "lora.rank=16")
    plan = plan_generator(cfg, world_size=3, gpu_memory=139 * GiB)
    gen = plan.phase("generation").terms
    assert gen["engine_weights"] == 2 * qwen3_8b_engine_params(1)  # the frozen base
    assert 0 < gen["lora_adapters"] < GiB
    # The first sync fills the base (the embedding alone in a bucket); a step's moves the adapters only.
    assert plan.phase("first_sync").terms["sync_bucket"] == V * D * 2
    assert plan.phase("sync").terms["sync_bucket"] <= gen["lora_adapters"]


def plan_cli(capsys, *args: str) -> tuple[int, list[str]]:
    rc = main(["plan", str(ROOT / "configs" / "quickstart.toml"), *args, "--json"])
    return rc, capsys.readouterr().out.splitlines()


def test_plan_nproc_3_with_a_generator_prints_both_plans(capsys):
    rc, out = plan_cli(capsys, "--nproc", "3", "--set", "distributed.generator_ranks=1", "--gpu-memory", "80")
    text = "\n".join(out)
    assert rc == 0, text
    assert "trainer ranks 0-1 of 3, FSDP2 over 2 ranks:" in text
    assert "generator rank 2 of 3, an engine each, serving 2 trainers each:" in text
    assert "first_sync" in text and "generator KV cache:" in text
    line = json.loads(out[-1])
    assert line["memory_plan"]["world_size"] == 2  # the trainers' FSDP2
    gen = line["generator_memory_plan"]
    assert gen["fits"] and set(gen["phases"]) == {"first_sync", "generation", "sync"}


def test_a_generator_that_cannot_fit_is_refused_naming_the_split():
    """qwen3-8b on 16 GiB: the weights (15.26 GiB) and the first sync's bucket do not fit one generator; split
    over two (one more generator rank) they do. 24 GiB fit as it is."""
    cfg = generator_cfg("distributed.generator_ranks=1")
    plan = make_generator_plan(cfg, world_size=3, gpu_memory=16 * GiB)
    assert not plan.fits
    why = plan.refusal()
    assert why.startswith("memory plan (generator rank 2 of 3, an engine each, serving 2 trainers each):")
    assert "--nproc 4 with distributed.generator_ranks=2 engine.tensor_parallel=2 (peak" in why
    assert make_generator_plan(cfg, world_size=3, gpu_memory=24 * GiB).fits
    # (`exactrl plan` prints the refusal and exits 1: the docs' example, below.)


def test_a_generator_rank_checks_its_plan_before_making_its_model(monkeypatch, capsys):
    """`serve_generator` on a (mocked) GPU: refused before `generator_engine` makes anything; on a larger one the
    first generator rank says its plan and goes on to make its engine."""

    class Props:
        total_memory = 16 * GiB

    class Made(Exception):
        pass

    def made(*a, **k):
        raise Made

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: Props)
    monkeypatch.setattr(disagg, "rank_device", lambda world, dev: torch.device("cuda", 0))
    monkeypatch.setattr(disagg, "generator_engine", made)
    layout = SimpleNamespace(world=SimpleNamespace(rank=2, world_size=3), trainers=2)
    cfg = generator_cfg("distributed.generator_ranks=1")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:  # serve_generator leaves the signals to the trainers
        with pytest.raises(MemoryPlanError, match="engine.tensor_parallel=2"):
            disagg.serve_generator(cfg, layout)
        Props.total_memory = 24 * GiB
        with pytest.raises(Made):
            disagg.serve_generator(cfg, layout)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert "memory plan (generator rank 2 of 3, an engine each" in capsys.readouterr().out


def test_docs_memory_generator_blocks_are_what_plan_prints(capsys):
    """docs/memory.md's generator examples (qwen3-30b-a3b, 2 + 2 at E = 2 on 139 GiB; 2 + 1 on 60 GiB, refused):
    every line of its two blocks is a line `exactrl plan` prints for the commands the page gives."""
    doc = (ROOT / "docs" / "memory.md").read_text()
    section = doc[doc.index("### A generator rank") :]
    blocks = section.split("```")[1::2]
    assert len(blocks) == 2
    base = ["model.preset=qwen3-30b-a3b", "model.dtype=bfloat16", "run.device=cuda"]
    base += ["algorithm.rollouts_per_step=128", "engine.max_model_len=1024", "sampling.max_tokens=512"]
    base += ["train.offload=optimizer", "train.fsdp_reduce=microbatch", "train.activation_checkpointing=true"]
    sets = [x for s in base for x in ("--set", s)]
    split = ["--set", "distributed.generator_ranks=2", "--set", "engine.expert_parallel=2", "--nproc", "4"]
    rc, out = plan_cli(capsys, *sets, *split, "--gpu-memory", "139", "--host-memory", "256")
    assert rc == 0
    for line in blocks[0].strip().splitlines():
        assert line in out, line
    one = ["--set", "distributed.generator_ranks=1", "--nproc", "3"]
    rc, out = plan_cli(capsys, *sets, *one, "--gpu-memory", "60", "--host-memory", "256")
    assert rc == 1 and blocks[1].strip() in out
