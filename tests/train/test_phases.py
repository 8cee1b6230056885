"""Memory phases (exactrl/train/phases.py): the KV cache leaves the device while the trainer runs and comes back
for the next generation, the plan counts each term only in the phases that hold it, and no bit changes.

What a CPU shows: the engine's cache released and allocated again (zero-filled, same shape, decode graphs dropped
exactly when it moved); a whole RL run with the release on equals the run with it off in every metric and
weight bit, and a planted bug (a cache allocated again without its zero-fill) breaks that; during the trainer's
step the engine holds no cache; the cache the run allocates is the plan's; the plan's phases for the README's
workloads at 80 GB. The FSDP2 replica's release is tested under torchrun (tests/distributed/test_phases_multirank.py).
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch

from exactrl.config import apply_overrides, load_config
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.runner import ModelRunner
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.train.memory import GiB, kv_cache_bytes, model_config, plan_memory
from exactrl.train.memory_fit import make_plan
from exactrl.train.stages import RunStages

sys.path.insert(0, str(Path(__file__).parent))
from test_plan import plugin, rl_cfg, run_cfg, run_records, run_weights, same_run  # noqa: E402,F401  (the plugin fixture too)

ROOT = Path(__file__).resolve().parents[2]
H100 = int(79.6 * GiB)  # what torch reports for an "80 GB" H100
PROMPTS = [[(5 * i + j) % 250 + 3 for j in range(4 + 3 * i)] for i in range(5)]


def _flat(outs):
    return [(s.token_ids, s.rollout_logprobs) for o in outs for s in o.samples]


# ----------------------------------------------------------------------------------------------------------
# The engine's cache: released, allocated again
# ----------------------------------------------------------------------------------------------------------


def test_released_cache_comes_back_zeroed_and_generates_the_same_bits():
    model = build_model(preset("tiny"), dtype=torch.float32, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=3)
    eng = RolloutEngine(model, EngineConfig(num_kv_blocks=16, max_num_seqs=8, max_model_len=64))
    eng.decode_mode = "static"  # the graph path's buffers, run eagerly
    first = _flat(eng.generate(PROMPTS, params))
    r = eng.runner
    nbytes = r.kv_cache_bytes
    c = model.config  # K and V of every layer, 16 blocks + the scratch block of 16 tokens, fp32
    assert nbytes == 2 * c.num_layers * 17 * 16 * c.num_kv_heads * c.head_dim * 4
    assert eng.release_kv() == nbytes and r.kv_released and r.kv_caches == [] and r.kv_cache_bytes == 0
    with pytest.raises(RuntimeError, match="KV cache is released"):
        r.refresh_graphs()
    r.allocate_kv()
    assert r.kv_cache_bytes == nbytes and all(not k.any() and not v.any() for k, v in r.kv_caches)
    # Every layer's K and V are views of one buffer: the cache moves as a whole or not at all.
    base = r.kv_caches[0][0].data_ptr()
    assert [k.data_ptr() for k, _ in r.kv_caches] == [
        base + 2 * i * k.numel() * 4 for i, (k, _) in enumerate(r.kv_caches)
    ]
    eng.release_kv()
    again = _flat(eng.generate(PROMPTS, params))  # generate allocates it again itself
    assert eng.runner is r and r.kv_allocations == 3
    assert len(first) == len(again)
    for (ta, la), (tb, lb) in zip(first, again):
        assert ta == tb and torch.equal(la, lb)


def test_decode_graphs_are_dropped_exactly_when_the_cache_moved():
    model = build_model(preset("tiny"), dtype=torch.float32, seed=0)
    runner = ModelRunner(model, 8, 16, max_num_seqs=4, max_model_len=32, decode_mode="static")
    st = runner._static_state()
    runner.release_kv()
    runner.allocate_kv()
    runner.refresh_graphs()
    same = runner.kv_caches[0][0].data_ptr() == st.kv_ptr
    assert (runner._static is st) == same  # the allocator decides where it lands; the check follows it
    st = runner._static_state()
    held = runner._kv_flat  # the old buffer stays alive: the new one cannot land at its address
    runner.release_kv()
    runner.allocate_kv()
    assert runner.kv_caches[0][0].data_ptr() != held.data_ptr()
    runner.refresh_graphs()
    assert runner._static is None


# ----------------------------------------------------------------------------------------------------------
# A whole run: release on == release off, bit for bit
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("plugin")
def test_rl_run_with_the_release_is_bitwise_the_same(tmp_path, monkeypatch):
    from exactrl.train.loop import train

    torch.set_num_threads(1)
    quiet = lambda *a, **k: None  # noqa: E731
    train(rl_cfg(tmp_path / "kept", "engine.release_memory=false"), out=quiet)
    # The released run, with the engine's cache checked absent while the trainer's step runs.
    seen: list[int] = []
    real_update = RunStages.update

    def update(self, step, rollouts, *a, **k):
        seen.append(self.engine.runner.kv_cache_bytes)
        return real_update(self, step, rollouts, *a, **k)

    monkeypatch.setattr(RunStages, "update", update)
    train(rl_cfg(tmp_path / "released"), out=quiet)
    assert seen == [0, 0]
    assert same_run(tmp_path / "kept", tmp_path / "released")
    # Negative control: a cache allocated again whose layer views overlap (layer i's V is layer i+1's K), as a
    # wrong offset into the flat buffer would make them: the released run's later generations change.
    real = ModelRunner.allocate_kv

    def overlapping(self):
        again = self.kv_released and self.kv_allocations > 0
        real(self)
        if again:
            per, flat = math.prod(self.kv_shape), self._kv_flat
            view = lambda j: flat[j * per : (j + 1) * per].view(self.kv_shape)  # noqa: E731
            self.kv_caches = [(view(i), view(i + 1)) for i in range(len(self.kv_caches))]

    monkeypatch.setattr(ModelRunner, "allocate_kv", overlapping)
    cfg = rl_cfg(tmp_path / "bad", "run.on_mismatch=warn")
    train(cfg, out=quiet)
    assert not same_run(tmp_path / "kept", tmp_path / "bad")


@pytest.mark.usefixtures("plugin")
def test_steps_without_an_update_get_their_cache_back(tmp_path, monkeypatch):
    """Step 1 dropped by the guard (run.on_mismatch = "skip_step": one rollout logprob moved by one ulp), step 2
    skipped for a non-finite loss (a NaN advantage), step 3 an update: after each, the next generation has its KV
    cache back and samples the same bits as the run that never released it. (Under torchrun the replica too:
    tests/distributed/test_phases_multirank.py.)"""
    import json

    from exactrl.train.loop import train

    torch.set_num_threads(1)
    real_update = RunStages.update
    held: list[int] = []

    def update(self, step, rollouts, *a, **k):
        held.append(self.engine.runner.kv_cache_bytes)
        if step == 0:
            lp = rollouts[0].rollout_logprobs.clone()
            lp[0] = torch.nextafter(lp[0], torch.tensor(-math.inf))
            rollouts[0].rollout_logprobs = lp
        if step == 1:
            rollouts[0].advantage = math.nan
        return real_update(self, step, rollouts, *a, **k)

    monkeypatch.setattr(RunStages, "update", update)
    quiet = lambda *a, **k: None  # noqa: E731
    sets = ("train.steps=3", "run.on_mismatch=skip_step")
    train(rl_cfg(tmp_path / "kept", *sets, "engine.release_memory=false"), out=quiet)
    assert min(held) > 0
    held.clear()
    train(rl_cfg(tmp_path / "released", *sets), out=quiet)
    assert held == [0, 0, 0]
    rows = [r for r in run_records(tmp_path / "released") if "optimizer_steps" in r]
    assert [r["optimizer_steps"] for r in rows] == [0.0, 0.0, 1.0]
    assert rows[0]["mismatch/step_skipped"] == 1.0 and rows[1]["nan_skipped"] == 1.0
    assert [r["mismatch/num_mismatched_tokens"] for r in rows] == [1.0, 0.0, 0.0]
    # A skipped step logs NaN (no gradient norm), which equals itself only as text.
    assert json.dumps(run_records(tmp_path / "kept")) == json.dumps(run_records(tmp_path / "released"))
    wa, wb = run_weights(tmp_path / "kept"), run_weights(tmp_path / "released")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.usefixtures("plugin")
def test_the_run_allocates_the_plans_cache(tmp_path, monkeypatch):
    """The loop sizes the cache from the plan on a GPU; here the plan of a mocked 1 GiB device on the CPU run."""
    from exactrl.train import loop

    cfg = rl_cfg(tmp_path / "run", "train.steps=1")
    plan = plan_memory(cfg, gpu_memory=1 * GiB + (1 << 20), device="cuda")
    monkeypatch.setattr(loop, "check_before_loading", lambda *a, **k: plan)
    run = loop.RLRun(cfg, out=lambda *a, **k: None)
    try:
        run.run()
        assert run.engine.runner.num_blocks == plan.counts["kv_blocks"]
        assert run.engine.runner.kv_cache_bytes == plan.phase("generation").terms["kv_cache"]
        assert plan.counts["kv_blocks"] < plan.counts["rollout_tokens_needed"] // cfg.engine.block_size
    finally:
        run.close()


# ----------------------------------------------------------------------------------------------------------
# The plan per phase
# ----------------------------------------------------------------------------------------------------------


def test_the_plan_counts_released_terms_only_where_they_are_held():
    cfg = run_cfg("model.preset=qwen3-1.7b")
    on = make_plan(cfg, gpu_memory=H100)
    off = make_plan(apply_overrides(copy.deepcopy(cfg), ["engine.release_memory=false"]), gpu_memory=H100)
    kv = on.phase("generation").terms["kv_cache"]
    assert (
        kv > 0
        and "kv_cache" not in on.phase("training").terms
        and "kv_cache" not in on.phase("optimizer").terms
    )
    for ph in ("generation", "training", "optimizer"):
        assert "kv_cache" in off.phase(ph).terms
    # The cache is kv_memory_fraction of what the phases holding it leave free (the scratch block included).
    avail = on.available
    other = on.phase("generation").peak - kv
    block = kv_cache_bytes(cfg, model_config(cfg), 2, 1) // 2
    need = (on.counts["rollout_tokens_needed"] // cfg.engine.block_size + 2) * block
    assert kv <= cfg.engine.kv_memory_fraction * (avail - other)
    assert kv > min(need, cfg.engine.kv_memory_fraction * (avail - other)) - 2 * block  # the rule, to a block
    kept = off.phase("training").terms["kv_cache"]
    worst_other = max(p.peak - p.terms["kv_cache"] for p in off.phases)
    assert kept <= cfg.engine.kv_memory_fraction * (avail - worst_other)
    # Under FSDP2 the replica generates and is released for the other phases (unless one step off).
    four = make_plan(cfg, world_size=4, gpu_memory=H100)
    assert "engine_replica" in four.phase("generation").terms
    assert all("engine_replica" not in four.phase(p).terms for p in ("training", "optimizer"))
    # LoRA: only the adapters' part is released (the sync refreshes it anyway); the frozen base stays.
    lora4 = make_plan(apply_overrides(copy.deepcopy(cfg), ["lora.rank=8"]), world_size=4, gpu_memory=H100)
    frozen = lora4.counts["policy_frozen"] * 2
    assert all(
        lora4.phase(p).terms["engine_replica_frozen"] == frozen
        for p in ("generation", "training", "optimizer")
    )
    assert lora4.phase("generation").terms["engine_replica"] == lora4.counts["policy_trainable"] * 2
    assert "engine_replica" not in lora4.phase("training").terms
    off4 = make_plan(
        apply_overrides(copy.deepcopy(cfg), ["algorithm.max_off_policy_steps=1"]),
        world_size=4,
        gpu_memory=H100,
    )
    assert all(
        "engine_replica" in off4.phase(p).terms and "kv_cache" in off4.phase(p).terms
        for p in ("training", "optimizer")
    )
    # release_memory = false: a plan that fits only with the release names it. Without training graphs: a graph
    # pool holds the training microbatch's memory for the whole run, generation included, and then the release
    # frees nothing the training phase needs beyond generation's (the next test).
    fixed = ["engine.num_kv_blocks=3000", "train.cuda_graphs=false"]
    tight = make_plan(
        apply_overrides(copy.deepcopy(cfg), [*fixed, "engine.release_memory=false"]), gpu_memory=49 * GiB
    )
    assert not tight.fits and tight.worst.name == "training"
    assert any(s.startswith("engine.release_memory=true") for s in tight.suggestions), tight.suggestions
    assert make_plan(apply_overrides(copy.deepcopy(cfg), fixed), gpu_memory=49 * GiB).fits


def test_the_training_graph_pool_holds_the_microbatch_peak():
    """A captured microbatch allocates everything from the graphs' private pool, which keeps it between replays:
    the plan's pool is the activations plus the larger of the LM head's backward (its kept logits) and a layer's
    backward working set, held in the generation phase too; without graphs those terms are the training
    phase's own."""
    cfg = run_cfg("model.preset=qwen3-1.7b")
    graphs = make_plan(cfg, gpu_memory=H100)
    eager = make_plan(apply_overrides(copy.deepcopy(cfg), ["train.cuda_graphs=false"]), gpu_memory=H100)
    t = eager.phase("training").terms
    pool = graphs.phase("generation").terms["train_graph_pool"]
    assert pool == t["activations"] + max(t["backward_working_set"], t["lm_head_logprobs"])
    assert t["lm_head_logprobs"] > t["backward_working_set"]  # qwen3-1.7b at this size: the kept logits
    assert graphs.phase("training").terms["train_graph_pool"] == pool
    assert not {"activations", "backward_working_set", "lm_head_logprobs"} & set(
        graphs.phase("training").terms
    )


def test_the_lm_head_term_covers_every_call_the_op_may_keep():
    """The logprob op keeps a call's logits by the rows it gets (a microbatch's completion tokens, any number up to
    the budget): the plan's LM-head term for a budget covers the largest logits any call within it keeps, so it
    never shrinks as the budget grows."""
    from exactrl.ops.triton.logprobs import keeps_logits
    from exactrl.train.memory import _lm_head_bytes

    mcfg = model_config(run_cfg("model.preset=qwen3-0.6b"))
    v = mcfg.vocab_size
    largest_kept = max(r for r in range(0, 40000, 16) if keeps_logits(r, v, 2)) * v * 2
    terms = [_lm_head_bytes(mcfg, t, 2, True, False) for t in (4096, 8192, 10000, 12000, 16384, 32768)]
    assert terms == sorted(terms)
    assert all(t >= largest_kept for t in terms[2:])


def test_moe_trains_without_graphs_and_the_plan_knows_it():
    dense = make_plan(run_cfg(), gpu_memory=H100)
    moe = make_plan(run_cfg("model.preset=tiny-moe"), gpu_memory=H100)
    assert "train_graph_pool" in dense.phase("generation").terms and dense.counts["train_graphs"] == 1
    assert moe.counts["train_graphs"] == 0
    assert "train_graph_pool" not in moe.phase("generation").terms
    assert moe.phase("training").terms["activations"] > 0  # transient, in the training phase only
    assert "activations" not in moe.phase("generation").terms


def _bench_rl_config(*argv: str):
    """The config `exactrl bench rl` runs, from its real argument parser with the README's flags."""
    import exactrl.bench_rl as bench_rl
    from exactrl.cli import main

    got = {}

    def capture(args):
        got["args"] = args
        return 0

    real = bench_rl.main
    bench_rl.main = capture
    try:
        main(["bench", "rl", *argv])
    finally:
        bench_rl.main = real
    return bench_rl._config(got["args"], "runs/bench-rl", 4)


def test_readme_commands_fit_80_gb_with_their_defaults():
    """`exactrl bench rl --preset qwen3-1.7b --mode exact` (which ran out of memory on an H100 before the
    phases), configs/qwen3-0.6b-gsm8k.toml and the 8B full fine-tune with offload and checkpointing."""
    bench = _bench_rl_config("--preset", "qwen3-1.7b", "--mode", "exact", "--device", "cuda")
    plan = make_plan(bench, gpu_memory=H100)
    assert plan.fits, plan.table()
    # Before the phases: the cache beside the training graphs in every phase.
    kept = make_plan(apply_overrides(copy.deepcopy(bench), ["engine.release_memory=false"]), gpu_memory=H100)
    assert kept.phase("training").terms["kv_cache"] > 0
    gsm8k = load_config(
        str(ROOT / "configs" / "qwen3-0.6b-gsm8k.toml"), ["model.path=null", "model.preset=qwen3-0.6b"]
    )
    assert make_plan(gsm8k, gpu_memory=H100).fits
    big = load_config(
        str(ROOT / "configs" / "quickstart.toml"),
        [
            "model.preset=qwen3-8b",
            "model.dtype=bfloat16",
            "train.offload=optimizer",
            "train.activation_checkpointing=true",
        ],
    )
    plan8 = make_plan(big, gpu_memory=H100)
    assert plan8.fits and plan8.peak < 64 * GiB, plan8.table()
    assert not make_plan(apply_overrides(copy.deepcopy(big), ["train.offload=none"]), gpu_memory=H100).fits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_survive_a_released_cache_on_gpu():
    """On the GPU: the decode graphs replay after the cache came back (kept at the same address, or captured
    again), and give the eager engine's bits."""
    from exactrl.ops import set_exact_environment

    set_exact_environment(True)
    model = build_model(preset("tiny"), device="cuda", dtype=torch.bfloat16, exact=True, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=5)
    sizes = dict(max_num_seqs=16, max_model_len=96, num_kv_blocks=32)
    graph = RolloutEngine(model, EngineConfig(**sizes))
    eager = RolloutEngine(model, EngineConfig(**sizes))
    eager.decode_mode = "eager"
    ref = _flat(eager.generate(PROMPTS, params))
    for _ in range(3):
        got = _flat(graph.generate(PROMPTS, params))
        for (ta, la), (tb, lb) in zip(ref, got):
            assert ta == tb and torch.equal(la, lb)
        before = torch.cuda.memory_allocated()
        freed = graph.release_kv()
        assert freed > 0 and torch.cuda.memory_allocated() == before - freed
    r = graph.runner
    print(
        f"kv allocations {r.kv_allocations}, graphs dropped {r.graphs_dropped}, capture {r.capture_seconds:.2f} s"
    )
