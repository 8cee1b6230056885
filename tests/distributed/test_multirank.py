"""Multi-rank runs on the CPU (gloo), launched as `python -m torch.distributed.run --standalone` subprocesses.

One module-scoped fixture makes every run (a few launches, several jobs each: starting torch and the process group
is the expensive part on a 2-core machine) and the tests read their outputs:

- exact at world sizes 1 (under torchrun), 2 and 4 for GRPO, GSPO and PPO (mismatch/num_mismatched_tokens is 0,
  summed over every rank's tokens); fast mode at world size 2 is the negative control;
- world size 1 (no torchrun) vs 2 and 4: the same objective (loss, grad norm, rewards per step);
- resume across world sizes (2 -> 1 with and without torchrun, 1 -> 2) matches the uninterrupted run;
- the engine replica holds the very bits the trainer's forward computes with, on every rank;
- a failing rank stops every rank, quickly, with its error shown;
- LoRA at world size 2: exact, the objective of one device, only the adapters synced, checkpoints with the
  adapters, resumed at world size 1.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from ._runs import REWARD, _timing, launch
from ._runs import crashed_after as _crashed_after
from ._runs import plain as _plain

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("_driver.py")
CONFIGS = {
    a: ROOT / "configs" / f"quickstart{s}.toml" for a, s in (("grpo", ""), ("gspo", "-gspo"), ("ppo", "-ppo"))
}

# The quickstart shrunk: 16 rollouts (4 prompts x 4), 4-token completions, 3 SFT steps, a constant lr.
SMALL = [
    "train.warmup_steps=0",
    "train.lr_schedule=constant",
    "sft.steps=3",
    "sft.batch_size=8",
    "sft.warmup_steps=0",
    "algorithm.rollouts_per_step=16",
    "algorithm.group_size=4",
    "task.num_eval=4",
    "task.eval_every=0",
    "sampling.max_tokens=4",
    "run.progress=false",
    "run.tensorboard=false",
    "run.report=false",
    "train.keep_checkpoints=4",
]
STEPS = 4  # the runs that are compared step by step; the others run 2
# Two model turns around an observation, a reward that varies within a group (tests/envs/sample_envs.py, importable
# by the ranks as _mt_env): the env/* metrics.
MULTI_TURN = (
    "env.name=_mt_env:VaryingReward",
    "env.isolation=thread",
    "env.max_turns=2",
    "env.max_episode_tokens=64",
)


def _argv(
    tmp: Path, name: str, algo: str = "grpo", steps: int = 2, *extra: str, resume: bool = False
) -> list:
    sets = [*SMALL, f"train.steps={steps}", f"run.output_dir={tmp / name}"]
    sets.append(f'reward.functions=["{tmp / "reward.py"}:hashed"]')
    sets += list(extra)
    argv = ["train", str(CONFIGS[algo]), *[x for s in sets for x in ("--set", s)]]
    return argv + (["--resume"] if resume else ["--overwrite"])


def _launch(
    tmp: Path, nproc: int, jobs: list[dict], tag: str, timeout: float = 240
) -> tuple[int, str, float]:
    return launch(DRIVER, tmp, nproc, jobs, tag, timeout)


def _steps(run: Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multirank")
    (tmp / "reward.py").write_text(REWARD)
    times: dict[str, float] = {}

    def launch(nproc, jobs, tag):
        code, out, secs = _launch(tmp, nproc, jobs, tag)
        times[tag] = secs
        assert code == 0, f"launch {tag} ({nproc} ranks) failed:\n{out[-6000:]}"
        (tmp / f"{tag}.log").write_text(out)
        return out

    def cli(name, algo="grpo", steps=2, *extra, resume=False):
        return {"kind": "cli", "argv": _argv(tmp, name, algo, steps, *extra, resume=resume)}

    ckpt = "train.save_every=1"
    # GRPO runs the steps that are compared; one step each shows the other algorithms exact.
    # Multi-turn episodes (the env/* metrics), one process and two ranks: test_every_metric_is_global.
    mt = ("sft.steps=0", *MULTI_TURN)
    launch(
        1,
        [cli("t1-grpo", "grpo", STEPS, ckpt), cli("t1-gspo", "gspo", 1), cli("t1-ppo", "ppo", 1)]
        + [cli("t1-mt", "grpo", 2, *mt)],
        "ws1",
    )
    _crashed_after(tmp / "t1-grpo", tmp / "r12", 2)
    jobs = [cli("t2-grpo", "grpo", STEPS, ckpt), cli("t2-gspo", "gspo", 1), cli("t2-ppo", "ppo", 1)]
    jobs += [cli("t2-fast", "grpo", 1, "run.exact=false"), cli("r12", "grpo", STEPS, ckpt, resume=True)]
    jobs += [cli("t2-mt", "grpo", 2, *mt)]
    # A node that does not share the run directory: rank 1 works in node1/, where the relative run.output_dir is
    # another folder (test_a_rank_that_cannot_see_the_run_directory_is_refused). Every rank refuses (exit 2).
    private = cli("unshared")
    private["argv"] = [
        a.replace(f"run.output_dir={tmp / 'unshared'}", "run.output_dir=unshared") for a in private["argv"]
    ]
    jobs += [{**private, "cwd_rank": {"1": str(tmp / "node1")}, "expect_code": 2}]
    # A full fine-tune with a KL reference (a frozen copy, sharded in bf16), one step; its FSDP2 microbatch budget
    # set apart from max_tokens_per_microbatch (40 tokens: a rank's 8 rollouts need more than one microbatch; 2
    # when the setting was planted away).
    mb = ("train.max_tokens_per_microbatch=40", "train.fsdp_tokens_per_microbatch=4096")
    jobs += [cli("t2-kl", "grpo", 1, "algorithm.kl_coef=0.05", "model.dtype=bfloat16", *mb)]
    # `exactrl parity` on 2 ranks, bf16 (each rank's engine against the FSDP-sharded trainer forward); it exits
    # non-zero, failing the launch, on any mismatch (FSDP casting the layers' fp32 inputs made all 384 differ).
    parity = ["parity", "--device", "cpu", "--dtype", "bfloat16", "--num-prompts", "2", "--max-tokens", "4"]
    jobs += [{"kind": "cli", "argv": parity}]
    jobs += [
        {"kind": "weights", "out": str(tmp / "weights.json")},
        {"kind": "weights", "out": str(tmp / "weights-nosync.json"), "skip_sync": True},
        {"kind": "per_rank", "out": str(tmp / "per-rank.json")},
    ]
    launch(2, jobs, "ws2")
    _crashed_after(tmp / "t2-grpo", tmp / "r21p", 2)

    # World size 1 without torchrun: today's single-device path, in a process of its own (both runs in one).
    code, out, times["plain"] = _plain(
        tmp, [_argv(tmp, "p1-grpo", "grpo", STEPS), _argv(tmp, "r21p", "grpo", STEPS, ckpt, resume=True)]
    )
    assert code == 0, out[-6000:]
    # A 2-rank checkpoint with rank 1's shard removed, resumed on one process: refused by name, nothing changed
    # (test_a_checkpoint_with_a_shard_removed_is_refused_by_name).
    _crashed_after(tmp / "t2-grpo", tmp / "torn", 2)
    (tmp / "torn" / "checkpoints" / "step-000002" / "dcp" / "__1_0.distcp").unlink()
    code, out, _ = _plain(tmp, [_argv(tmp, "torn", "grpo", STEPS, ckpt, resume=True)])
    (tmp / "torn.log").write_text(f"exit {code}\n{out}")
    print("launch wall times (s):", json.dumps({k: round(v, 1) for k, v in times.items()}))
    return tmp


LORA = ("lora.rank=4", "algorithm.kl_coef=0.05")  # the reference is the base with the adapters off


@pytest.fixture(scope="module")
def runs_lora(runs):
    """LoRA under torchrun beside the other runs (under `make test-all`; LoRA at world size 2 one step off runs by
    default in test_offpolicy_dist): 4 steps at world size 2, a bf16 run, a resume 2 -> 1, the one-device run."""
    tmp, ckpt = runs, "train.save_every=1"
    jobs = [
        {"kind": "cli", "argv": _argv(tmp, "t2-lora", "grpo", STEPS, ckpt, *LORA)},
        # bf16: the frozen base stays 16-bit in the shards beside the fp32 adapters.
        {"kind": "cli", "argv": _argv(tmp, "t2-lora16", "grpo", 2, ckpt, *LORA, "model.dtype=bfloat16")},
    ]
    code, out, _ = _launch(tmp, 2, jobs, "ws2-lora")
    assert code == 0, f"launch ws2-lora failed:\n{out[-6000:]}"
    _crashed_after(tmp / "t2-lora", tmp / "r21-lora", 2)
    resume = _argv(tmp, "r21-lora", "grpo", STEPS, ckpt, *LORA, resume=True)
    code, out, _ = _launch(tmp, 1, [{"kind": "cli", "argv": resume}], "ws1-resume-lora")
    assert code == 0, f"launch ws1-resume-lora failed:\n{out[-6000:]}"
    code, out, _ = _plain(tmp, [_argv(tmp, "p1-lora", "grpo", STEPS, *LORA)])
    assert code == 0, out[-6000:]
    return tmp


@pytest.fixture(scope="module")
def runs_r21t(runs):
    """The 2 -> 1 resume under torchrun (under `make test-all`: by default the 2 -> 1 resume runs without torchrun,
    and the torchrun path at world size 1 in the ws1 launch)."""
    _crashed_after(runs / "t2-grpo", runs / "r21t", 2)
    argv = _argv(runs, "r21t", "grpo", STEPS, "train.save_every=1", resume=True)
    code, out, _ = _launch(runs, 1, [{"kind": "cli", "argv": argv}], "ws1-resume")
    assert code == 0, f"launch ws1-resume failed:\n{out[-6000:]}"
    return runs


@pytest.fixture(scope="module")
def runs4(runs):
    """World size 4 beside the other runs (4 ranks on CI's 2 cores: under `make test-all` only)."""
    tmp = runs
    jobs = [
        {"kind": "cli", "argv": _argv(tmp, name, algo, steps)}
        for name, algo, steps in (("t4-grpo", "grpo", 2), ("t4-gspo", "gspo", 1), ("t4-ppo", "ppo", 1))
    ]
    code, out, _ = _launch(tmp, 4, jobs, "ws4")
    assert code == 0, f"launch ws4 (4 ranks) failed:\n{out[-6000:]}"
    return tmp


# ----------------------------------------------------------------------------------------------------------
# Exact at every world size
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ws", [1, 2, pytest.param(4, marks=pytest.mark.extended)])
@pytest.mark.parametrize("algo", ["grpo", "gspo", "ppo"])
def test_no_mismatched_token_at_any_world_size(request, runs, ws, algo):
    if ws == 4:
        runs = request.getfixturevalue("runs4")
    run = runs / f"t{ws}-{algo}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == ws
    steps = _steps(run)
    assert len(steps) >= 1
    for step, m in steps.items():
        # The count is over every rank's tokens: all the step's completion tokens were compared.
        all_tokens = round(m["response_length/mean"] * 16)
        assert m["mismatch/num_tokens"] == all_tokens > 0, (step, m["mismatch/num_tokens"], all_tokens)
        assert m["mismatch/num_mismatched_tokens"] == 0, (algo, ws, step)
    assert summary["mismatched_tokens_total"] == 0
    assert summary["compared_tokens_total"] == sum(m["mismatch/num_tokens"] for m in steps.values())


def test_fast_mode_mismatches_at_world_size_2(runs):
    """The negative control: PyTorch's default kernels (run.exact = false). The trainer then recomputes the old
    logprobs, and the same metric counts how many differ from the engine's."""
    steps = _steps(runs / "t2-fast")
    assert sum(m["mismatch/num_mismatched_tokens"] for m in steps.values()) > 0
    assert all(m["mismatch/num_tokens"] > 0 for m in steps.values())


# ----------------------------------------------------------------------------------------------------------
# The same objective at every world size
# ----------------------------------------------------------------------------------------------------------

KEYS = ("loss", "grad_norm", "reward/mean", "num_tokens", "entropy")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def _agree(ref: Path, other: Path, steps: list[int], rtol: float) -> dict[str, float]:
    a, b = _steps(ref), _steps(other)
    worst = dict.fromkeys(KEYS, 0.0)
    for s in steps:
        for k in KEYS:
            assert math.isfinite(a[s][k]) and math.isfinite(b[s][k])
            worst[k] = max(worst[k], _rel(a[s][k], b[s][k]))
    # Rollouts are sampled from weights equal to the last bits, or nearly: the same tokens, the same rewards.
    for s in steps:
        assert a[s]["reward/mean"] == b[s]["reward/mean"], s
        assert a[s]["num_tokens"] == b[s]["num_tokens"], s
    assert worst["grad_norm"] <= rtol and worst["loss"] <= rtol and worst["entropy"] <= rtol, worst
    assert all(a[s]["grad_norm"] > 0 for s in steps)  # the updates are not trivially zero
    return worst


# What two runs of the same global batch may log differently: timings (`_runs._timing`), a rank's own figures
# (`per_rank_metric`'s name/rank<r>, logged under several ranks only) and, in summary.json, the world size.
PER_PROCESS_SUMMARY = ("world_size",)


def _per_process(key: str) -> bool:
    return _timing(key) or re.search(r"/rank\d+$", key) is not None


def _differences(a: dict, b: dict, rtol: float = 1e-5) -> list[str]:
    """Keys whose values differ beyond rounding (fp32 sums over other shardings), or that one side lacks."""
    out = []
    for k in sorted(set(a) | set(b)):
        if _per_process(k):
            continue
        if k not in a or k not in b:
            out.append(f"{k}: only in {'the first' if k in a else 'the second'}")
        elif isinstance(a[k], (int, float)) and isinstance(b[k], (int, float)) and not isinstance(a[k], bool):
            if not math.isclose(a[k], b[k], rel_tol=rtol, abs_tol=1e-7):
                out.append(f"{k}: {a[k]} vs {b[k]}")
        elif a[k] != b[k]:
            out.append(f"{k}: {a[k]!r} vs {b[k]!r}")
    return out


@pytest.mark.parametrize("name", ["grpo", "mt"])
def test_every_metric_is_global(runs, name):
    """Every logged key of a 2-rank run equals the one-process run's of the same global batch (single-turn GRPO, 4
    steps; multi-turn episodes, 2 steps): counts over every rank's samples and episodes (env/episodes is 16, not
    rank 0's 8), means and maxima over all of them. Only timings and a rank's own figures differ (listed above)."""
    one, two = runs / f"t1-{name}", runs / f"t2-{name}"
    a = [json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (two / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) > 2
    if name == "mt":
        steps = [r for r in a if "loss" in r]
        assert steps and all(r["env/episodes"] == r["num_seqs"] == 16 for r in steps)
    bad = {i: d for i, (x, y) in enumerate(zip(a, b)) if (d := _differences(x, y))}
    assert not bad, bad
    sa, sb = (json.loads((r / "summary.json").read_text()) for r in (one, two))
    bad_summary = _differences(
        *({k: v for k, v in s.items() if k not in PER_PROCESS_SUMMARY} for s in (sa, sb))
    )
    assert not bad_summary, bad_summary


def test_a_rank_that_cannot_see_the_run_directory_is_refused(runs):
    """Rank 1 works where run.output_dir (relative) is a folder of its own, as on a node without the shared
    filesystem: at start-up rank 0's token is not there for it, and both ranks refuse with one line naming the path
    and rank 1, before anything is written (the folder the check made is gone again)."""
    out = (runs / "ws2.log").read_text()
    for rank in (0, 1):
        (line,) = [
            x for x in out.splitlines() if x.startswith(f"exactrl train (rank {rank}): error: rank(s) 1 (")
        ]
        assert "cannot see the run directory unshared of rank 0" in line and "run.output_dir" in line, line
    assert not (runs / "unshared").exists() and not (runs / "node1" / "unshared").exists()


def test_a_checkpoint_with_a_shard_removed_is_refused_by_name(runs):
    """A 2-rank checkpoint missing rank 1's shard (left on another node's disk): the resume is refused in one
    line naming the checkpoint and the shard, exit 2, before the run folder changes (no traceback)."""
    out = (runs / "torn.log").read_text()
    assert out.startswith("exit 2\n"), out[-3000:]
    ckpt = runs / "torn" / "checkpoints" / "step-000002"
    assert f"cannot resume from {ckpt}: shard dcp/__1_0.distcp is missing" in out
    assert "Traceback" not in out and "CheckpointException" not in out
    assert (runs / "torn" / "checkpoints" / "latest").read_text().strip() == "step-000002"
    assert not (runs / "torn" / "summary.json").exists()  # _crashed_after removed it; the refusal wrote none


def test_world_size_1_and_2_optimise_the_same_objective(runs):
    worst = _agree(runs / "p1-grpo", runs / "t2-grpo", list(range(1, STEPS + 1)), rtol=1e-5)
    print("max relative difference, world size 1 (plain) vs 2 over 4 steps:", worst)


def test_torchrun_1_agrees_with_plain(runs):
    print("ws1 plain vs ws1 torchrun:", _agree(runs / "p1-grpo", runs / "t1-grpo", [1, 2, 3, 4], rtol=1e-5))


@pytest.mark.extended
def test_world_size_4_agrees_with_plain(runs4):
    print("ws1 plain vs ws4:", _agree(runs4 / "p1-grpo", runs4 / "t4-grpo", [1, 2], rtol=1e-5))


# ----------------------------------------------------------------------------------------------------------
# Checkpoints and resume across world sizes
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("resumed", [pytest.param("r21t", marks=pytest.mark.extended), "r21p", "r12"])
def test_resume_at_another_world_size_continues_the_run(request, runs, resumed):
    """2 -> 1 (torchrun), 2 -> 1 (no torchrun), 1 -> 2: steps 3 and 4 of the resumed run agree with the
    uninterrupted world-size-2 run."""
    if resumed == "r21t":
        runs = request.getfixturevalue("runs_r21t")
    run = runs / resumed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and summary["mismatched_tokens_total"] == 0
    steps = _steps(run)
    assert sorted(steps) == [1, 2, 3, 4]  # the log was cut at the checkpoint and continued, no step twice
    print(resumed, "vs uninterrupted ws2:", _agree(runs / "t2-grpo", run, [3, 4], rtol=1e-5))


def test_sharded_checkpoint_layout_and_hf_export(runs):
    from exactrl.model.hf import load_model

    ck = runs / "t2-grpo" / "checkpoints" / f"step-{STEPS:06d}"
    assert (ck / "dcp").is_dir() and (ck / "state.json").is_file()
    # A full fine-tune writes its weights at every checkpoint (only a frozen LoRA base is linked).
    first = runs / "t2-grpo" / "checkpoints" / "step-000001" / "policy" / "model.safetensors"
    assert first.stat().st_ino != (ck / "policy" / "model.safetensors").stat().st_ino
    state = json.loads((ck / "state.json").read_text())
    assert state["step"] == STEPS and state["world_size"] == 2
    model = load_model(ck / "policy", device="cpu")
    # The export is the gathered full weights: every tensor of the model, at its full shape.
    assert sum(p.numel() for p in model.parameters()) > 0
    ref = load_model(runs / "t1-grpo" / "checkpoints" / f"step-{STEPS:06d}" / "policy", device="cpu")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape, n
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-5)  # ws2 and ws1 runs: the same up to rounding


# ----------------------------------------------------------------------------------------------------------
# LoRA under torchrun
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.extended
def test_lora_at_world_size_2_is_exact_and_optimises_the_one_device_objective(runs_lora):
    runs = runs_lora
    run = runs / "t2-lora"
    steps = _steps(run)
    assert sorted(steps) == [1, 2, 3, 4]
    for step, m in steps.items():
        assert m["mismatch/num_tokens"] == round(m["response_length/mean"] * 16) > 0, step
        assert m["mismatch/num_mismatched_tokens"] == 0, step
    print("LoRA ws1 plain vs ws2:", _agree(runs / "p1-lora", run, [1, 2, 3, 4], rtol=1e-5))
    # After each step only the adapters travel to the engine replica: a small fraction of the full model's bytes.
    full = _steps(runs / "t2-grpo")[1]["weight_sync/bytes"]
    for m in steps.values():
        assert 0 < m["weight_sync/bytes"] == m["perf/weight_sync_bytes"] < full / 5


@pytest.mark.extended
def test_a_bf16_lora_run_keeps_its_frozen_base_16_bit_in_the_shards_and_is_exact(runs_lora):
    from torch.distributed.checkpoint import FileSystemReader

    runs = runs_lora
    run = runs / "t2-lora16"
    steps = _steps(run)
    assert sorted(steps) == [1, 2]
    assert all(m["mismatch/num_mismatched_tokens"] == 0 < m["mismatch/num_tokens"] for m in steps.values())
    # The shards: the adapters in fp32 (the masters), the frozen base in the model dtype (half the memory).
    dcp_dir = run / "checkpoints" / "step-000002" / "dcp"
    meta = FileSystemReader(str(dcp_dir)).read_metadata().state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in meta.items() if k.startswith("policy.")}
    assert any("lora_" in k for k in dtypes) and any("lora_" not in k for k in dtypes)
    assert all((d == torch.float32) == ("lora_" in k) for k, d in dtypes.items()), dtypes
    assert all(d == torch.bfloat16 for k, d in dtypes.items() if "lora_" not in k)


def test_a_kl_reference_sharded_in_the_model_dtype_is_exact(runs):
    (m,) = _steps(runs / "t2-kl").values()
    assert m["mismatch/num_mismatched_tokens"] == 0 and m["mismatch/num_tokens"] > 0
    assert math.isfinite(m["kl_ref"])
    # train.fsdp_tokens_per_microbatch = 4096 reached the sharded trainer: one microbatch, where
    # max_tokens_per_microbatch = 40 packs each rank's 8 rollouts into more than one (2 with the setting ignored).
    assert m["perf/train_microbatches"] == 1


@pytest.mark.extended
def test_lora_sharded_checkpoints_hold_the_trained_adapters_and_resume_at_world_size_1(runs_lora):
    from safetensors.torch import load_file

    runs = runs_lora
    ck = runs / "t2-lora" / "checkpoints"
    first, last = ck / "step-000001", ck / f"step-{STEPS:06d}"
    for d in (first, last):
        assert (d / "dcp").is_dir() and (d / "policy").is_dir()
        assert (d / "adapter" / "adapter_config.json").is_file()
    a, b = (
        load_file(first / "adapter" / "adapter_model.safetensors"),
        load_file(last / "adapter" / "adapter_model.safetensors"),
    )
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the adapters trained
    # policy/ is the frozen base: the same at every step, written once and hard-linked by later checkpoints.
    for f in (first / "policy").iterdir():
        assert (last / "policy" / f.name).stat().st_ino == f.stat().st_ino, f.name
    base_a, base_b = (
        load_file(first / "policy" / "model.safetensors"),
        load_file(last / "policy" / "model.safetensors"),
    )
    assert base_a.keys() == base_b.keys() and all(torch.equal(base_a[k], base_b[k]) for k in base_a)
    # Crashed after step 2 at world size 2, resumed on one rank under torchrun: steps 3 and 4 agree.
    run = runs / "r21-lora"
    summary = json.loads((run / "summary.json").read_text())
    assert (
        summary["world_size"] == 1
        and summary["rl_steps"] == STEPS
        and summary["mismatched_tokens_total"] == 0
    )
    assert sorted(_steps(run)) == [1, 2, 3, 4]
    print("LoRA resumed 2 -> 1 vs uninterrupted ws2:", _agree(runs / "t2-lora", run, [3, 4], rtol=1e-5))


# ----------------------------------------------------------------------------------------------------------
# The engine's weights are the trainer's bits
# ----------------------------------------------------------------------------------------------------------


def test_engine_replica_equals_the_weights_the_trainer_computes_with(runs):
    reports = json.loads((runs / "weights.json").read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    for r in reports:
        assert r["params"] == r["captured"] > 0 and not r["not_plain"], r
        assert r["differ"] == [], r


def test_without_the_weight_sync_the_replica_is_stale(runs):
    reports = json.loads((runs / "weights-nosync.json").read_text())
    for r in reports:
        assert len(r["differ"]) == r["params"], r  # every tensor moved in the step; the replica did not


# ----------------------------------------------------------------------------------------------------------
# Metrics that differ between the ranks
# ----------------------------------------------------------------------------------------------------------


def test_per_rank_metric_holds_every_ranks_value(runs):
    """Peak memory (say) from every rank, not rank 0's alone: the maximum under the metric's name, each rank's
    own value under name/rank<r>, the same dict on every rank."""
    name = "perf/gpu_memory_peak_gb"
    on_each_rank = json.loads((runs / "per-rank.json").read_text())
    expected = {name: 11.5, f"{name}/rank0": 10.0, f"{name}/rank1": 11.5}
    assert on_each_rank == [expected, expected]


def test_per_rank_metric_on_one_process_is_the_value_itself():
    from exactrl.distributed.env import DistContext, per_rank_metric

    assert per_rank_metric(DistContext.single(), "perf/gpu_memory_peak_gb", 3.25) == {
        "perf/gpu_memory_peak_gb": 3.25
    }


# ----------------------------------------------------------------------------------------------------------
# A failing rank stops the run
# ----------------------------------------------------------------------------------------------------------


def test_a_failing_rank_stops_every_rank_with_its_error(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    job = {"kind": "cli", "argv": _argv(tmp_path, "fail", "grpo", 3), "fail_rank": 1}
    code, out, secs = _launch(tmp_path, 2, [job], "fail", timeout=120)
    print(f"failing run: exit {code} after {secs:.1f} s")
    assert code != 0
    assert "planted failure on rank 1 at step 1" in out
    assert secs < 60
    assert not (tmp_path / "fail" / "summary.json").exists()
