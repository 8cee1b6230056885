"""A mixture of experts (the tiny-moe preset) under FSDP2 on CPU ranks (gloo), as tests/distributed/test_multirank.py
does for the dense model:

- exact at world sizes 1 and 2 (1 under torchrun, and 4, under `make test-all`): every completion token of every rank
  compared, 0 differ; fast mode at world size 2 is the negative control;
- world sizes 2 and 4 optimise the objective of world size 1 (loss, grad norm, entropy; the same rewards);
- checkpoints: the stacked expert parameters (`experts.gate_up` [E, 2I, D], `experts.down` [E, D, I]) sharded in
  DCP, the HF export on rank 0 in per-expert names; resume 2 -> 1 and 1 -> 2 continue the run;
- the engine replica holds, after the weight sync, the bits the trainer's forward computes with, expert stacks
  included; without the sync it is stale; the sharded model's state dict (per-expert names) is the replica's.
"""

from __future__ import annotations

import json

import pytest
import torch

from ._runs import plain as _plain
from .test_multirank import (
    REWARD,
    _agree,
    _argv,
    _crashed_after,
    _launch,
    _steps,
)

pytestmark = pytest.mark.slow

STEPS = 3
MOE = ("model.preset=tiny-moe",)
CKPT = "train.save_every=1"
ZLOSS = ("train.moe_z_loss_coef=0.01",)
NUM_EXPERTS, SPARSE_LAYERS = 8, (1, 2, 3)  # tiny-moe: layer 0 is dense


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multirank-moe")
    (tmp / "reward.py").write_text(REWARD)
    times: dict[str, float] = {}

    def plain(name: str, *extra: str, resume: bool = False) -> list[str]:
        return _argv(tmp, name, "grpo", STEPS, *MOE, CKPT, *extra, resume=resume)

    def launch(nproc: int, jobs: list[dict], tag: str) -> None:
        code, out, secs = _launch(tmp, nproc, jobs, tag)
        times[tag] = secs
        assert code == 0, f"launch {tag} ({nproc} ranks) failed:\n{out[-6000:]}"

    def cli(name: str, steps: int = STEPS, *extra: str, resume: bool = False) -> dict:
        return {"kind": "cli", "argv": _argv(tmp, name, "grpo", steps, *MOE, *extra, resume=resume)}

    jobs = [cli("t2", STEPS, CKPT), cli("t2-fast", 1, "run.exact=false")]
    jobs += [cli("t2-aux", 2, *ZLOSS, "train.moe_aux_loss_coef=0.01"), cli("t2-z", STEPS, *ZLOSS)]
    jobs += [
        {"kind": "weights", "preset": "tiny-moe", "out": str(tmp / "weights.json")},
        {"kind": "weights", "preset": "tiny-moe", "out": str(tmp / "weights-nosync.json"), "skip_sync": True},
    ]
    launch(2, jobs, "ws2")
    _crashed_after(tmp / "t2", tmp / "r21", 2)
    # World size 1 without torchrun (today's single-device path) and the resume 2 -> 1 there: one process.
    code, out, times["plain"] = _plain(tmp, [plain("p1"), plain("p1-z", *ZLOSS), plain("r21", resume=True)])
    assert code == 0, out[-6000:]
    print("launch wall times (s):", json.dumps({k: round(v, 1) for k, v in times.items()}))
    return tmp


@pytest.fixture(scope="module")
def runs_ws1(runs):
    """World size 1 under torchrun (sharded DCP checkpoints) and its resume at world size 2 (under `make test-all`:
    the dense model's test_multirank.py runs both by default; here the 2 -> 1 resume does)."""
    code, out, _ = _launch(
        runs, 1, [{"kind": "cli", "argv": _argv(runs, "t1", "grpo", STEPS, *MOE, CKPT)}], "ws1"
    )
    assert code == 0, f"launch ws1 failed:\n{out[-6000:]}"
    _crashed_after(runs / "t1", runs / "r12", 2)
    resume = _argv(runs, "r12", "grpo", STEPS, *MOE, CKPT, resume=True)
    code, out, _ = _launch(runs, 2, [{"kind": "cli", "argv": resume}], "ws2-resume")
    assert code == 0, f"launch ws2-resume failed:\n{out[-6000:]}"
    return runs


@pytest.fixture(scope="module")
def runs4(runs):
    """World size 4 beside the other runs (4 ranks on CI's 2 cores: under `make test-all` only)."""
    argv = _argv(runs, "t4", "grpo", 2, *MOE)
    code, out, _ = _launch(runs, 4, [{"kind": "cli", "argv": argv}], "ws4")
    assert code == 0, f"launch ws4 (4 ranks) failed:\n{out[-6000:]}"
    return runs


@pytest.mark.parametrize(
    "run",
    [
        "p1",
        pytest.param("t1", marks=pytest.mark.extended),
        "t2",
        pytest.param("t4", marks=pytest.mark.extended),
        "t2-aux",
    ],
)
def test_moe_has_no_mismatched_token_at_any_world_size(request, runs, run):
    if run in ("t1", "t4"):
        runs = request.getfixturevalue({"t1": "runs_ws1", "t4": "runs4"}[run])
    summary = json.loads((runs / run / "summary.json").read_text())
    assert summary["world_size"] == {"p1": 1, "t1": 1, "t2": 2, "t4": 4, "t2-aux": 2}[run]
    steps = _steps(runs / run)
    assert len(steps) == (2 if run in ("t4", "t2-aux") else STEPS)
    for step, m in steps.items():
        all_tokens = round(m["response_length/mean"] * 16)  # every rank's completion tokens
        assert m["mismatch/num_tokens"] == all_tokens > 0, (run, step)
        assert m["mismatch/num_mismatched_tokens"] == 0, (run, step)
    assert summary["mismatched_tokens_total"] == 0


def test_moe_fast_mode_mismatches_at_world_size_2(runs):
    """The negative control: PyTorch's default kernels (per-expert F.linear without padding, index_add in the
    model dtype); the trainer's recomputed old logprobs then differ from the engine's."""
    steps = _steps(runs / "t2-fast")
    assert sum(m["mismatch/num_mismatched_tokens"] for m in steps.values()) > 0


def test_moe_world_sizes_optimise_the_same_objective(runs):
    print("MoE ws1 vs ws2:", _agree(runs / "p1", runs / "t2", list(range(1, STEPS + 1)), rtol=1e-5))


@pytest.mark.extended
def test_moe_world_size_1_under_torchrun_optimises_the_same_objective(runs_ws1):
    print(
        "MoE ws1 vs ws1 torchrun:",
        _agree(runs_ws1 / "p1", runs_ws1 / "t1", list(range(1, STEPS + 1)), rtol=1e-5),
    )


def _router_metrics_are_global(runs, run: str) -> None:
    """Step 1 samples from the same weights at every world size: the same tokens reach the same experts, so the
    load metrics summed over every rank's tokens are the one-device values, bit for bit (a rank's own share would
    differ); the entropy and the z-loss are means over all tokens, equal up to rounding."""
    one = _steps(runs / "p1")[1]
    assert one["moe/aux_loss"] > 0 and one["moe/router_entropy"] > 0
    m = _steps(runs / run)[1]
    for key in ("moe/load_max_over_mean", "moe/load_max_over_mean_worst", "moe/idle_experts"):
        assert m[key] == one[key], (run, key)
    assert m["moe/router_entropy"] == pytest.approx(one["moe/router_entropy"], rel=1e-6)
    assert m["moe/z_loss"] == pytest.approx(one["moe/z_loss"], rel=1e-6)


def test_moe_router_metrics_are_global(runs):
    _router_metrics_are_global(runs, "t2")


@pytest.mark.extended
def test_moe_world_size_4_optimises_the_same_objective_with_global_router_metrics(runs4):
    print("MoE ws1 vs ws4:", _agree(runs4 / "p1", runs4 / "t4", [1, 2], rtol=1e-5))
    _router_metrics_are_global(runs4, "t4")


def test_moe_z_loss_at_world_size_2_is_the_one_device_objective(runs):
    """The z-loss is a mean over every rank's tokens (unlike the per-microbatch load-balancing loss, whose value
    depends on how tokens are grouped): with it on, world size 2 optimises what world size 1 does."""
    print(
        "MoE z-loss ws1 vs ws2:", _agree(runs / "p1-z", runs / "t2-z", list(range(1, STEPS + 1)), rtol=1e-5)
    )
    # It trains: the runs' losses include it and differ from those without it.
    assert _steps(runs / "p1-z")[1]["loss"] != _steps(runs / "p1")[1]["loss"]


@pytest.mark.parametrize("resumed", ["r21", pytest.param("r12", marks=pytest.mark.extended)])
def test_moe_resume_at_another_world_size_continues_the_run(request, runs, resumed):
    """2 -> 1 (no torchrun) and 1 -> 2: step 3 of the resumed run agrees with the uninterrupted run."""
    if resumed == "r12":
        runs = request.getfixturevalue("runs_ws1")
    run = runs / resumed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and summary["mismatched_tokens_total"] == 0
    assert sorted(_steps(run)) == list(range(1, STEPS + 1))
    ref = runs / ("t2" if resumed == "r21" else "p1")
    print(resumed, _agree(ref, run, [STEPS], rtol=1e-5))


def test_moe_sharded_checkpoint_holds_the_expert_stacks_and_exports_per_expert_names(runs):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from exactrl.model.hf import load_model

    ck = runs / "t2" / "checkpoints" / f"step-{STEPS:06d}"
    meta = FileSystemReader(str(ck / "dcp")).read_metadata().state_dict_metadata
    for i in SPARSE_LAYERS:
        stem = f"policy.model.layers.{i}.mlp.experts"
        gate_up, down = meta[f"{stem}.gate_up"], meta[f"{stem}.down"]
        assert tuple(gate_up.size) == (NUM_EXPERTS, 128, 128) and tuple(down.size) == (NUM_EXPERTS, 128, 64)
        assert gate_up.properties.dtype == torch.float32  # the fp32 masters
        # The AdamW moments of the stacks are saved beside them (resume needs them).
        assert f"optim/policy.model.layers.{i}.mlp.experts.gate_up.exp_avg_sq" in meta
    # The HF export: per-expert names, no stacked name, at the shapes transformers reads.
    saved = load_file(str(ck / "policy" / "model.safetensors"))
    assert not any(k.endswith(("experts.gate_up", "experts.down")) for k in saved)
    for i in SPARSE_LAYERS:
        for e in range(NUM_EXPERTS):
            stem = f"model.layers.{i}.mlp.experts.{e}"
            assert saved[f"{stem}.gate_proj.weight"].shape == (64, 128)
            assert saved[f"{stem}.up_proj.weight"].shape == (64, 128)
            assert saved[f"{stem}.down_proj.weight"].shape == (128, 64)
    # The export loads back and is the world-size-1 run's model up to the reduction order's rounding.
    model = load_model(ck / "policy", device="cpu")
    ref = load_model(runs / "p1" / "checkpoints" / f"step-{STEPS:06d}" / "policy", device="cpu")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5, msg=n)
    # The experts trained between the first and the last checkpoint: the export is not a stale copy.
    first = load_file(str(runs / "t2" / "checkpoints" / "step-000001" / "policy" / "model.safetensors"))
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert not torch.equal(saved[name], first[name])


def test_moe_engine_replica_equals_the_trainers_forward_weights_expert_stacks_included(runs):
    reports = json.loads((runs / "weights.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["params"] == r["captured"] > 0 and not r["not_plain"], r
        assert r["differ"] == [], r
        assert len(r["expert_stacks"]) == 2 * len(SPARSE_LAYERS), r
        # The sharded model's state dict speaks the hub's per-expert names, gathered into plain tensors whose
        # model-dtype cast is the replica's.
        assert r["state_dict_keys"] and r["state_dict_experts"] == 3 * NUM_EXPERTS * len(SPARSE_LAYERS), r
        assert r["state_dict_dtensor_experts"] == [] and r["state_dict_differ"] == [], r


def test_moe_without_the_weight_sync_the_replica_is_stale(runs):
    for r in json.loads((runs / "weights-nosync.json").read_text()):
        assert set(r["expert_stacks"]) <= set(r["differ"]), r
        assert len(r["differ"]) == r["params"], r
