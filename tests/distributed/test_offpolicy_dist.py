"""One-step-off RL under torchrun (algorithm.max_off_policy_steps = 1) on CPU ranks (gloo), launched as
`python -m torch.distributed.run --standalone` subprocesses of `_offdist_driver.py`.

Default run (one launch at world size 2, bf16: the replica in bf16, the FSDP2 masters in fp32):
- a 3-step run is exact (0 mismatched over every rank's tokens), one version behind after the first step, samples
  from the engine replica the weight sync refreshes (no third copy), which holds the version its batch is tagged
  with and does not change while the worker samples; the FSDP2 forward gives the replica's guard bits;
- a one-ulp fault planted on rank 1 is caught before the update on *every* rank (no hang, no update applied).
Slow: resume bitwise at world size 2 and split at world size 1, skip_step agreed over the ranks, a worker failing on
rank 1 stops every rank with its error, k = 0 never touches the off-policy machinery, world size 4 (GRPO and PPO).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("_offdist_driver.py")
CONFIG = ROOT / "configs" / "quickstart.toml"

REWARD = '''
import hashlib


def hashed(completion, answer, example):
    """Rewards that vary within a group (a random tiny model never solves the arithmetic)."""
    return (int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 5) / 4
'''

# The quickstart shrunk (as tests/distributed/test_multirank.py): 16 rollouts of 4 prompts, 4-token completions.
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
    "train.keep_checkpoints=4",
    "train.save_every=1",
    "algorithm.max_off_policy_steps=1",
]
BF16 = "model.dtype=bfloat16"


def _argv(tmp: Path, name: str, steps: int, *extra: str, resume: bool = False) -> list[str]:
    sets = [*SMALL, f"train.steps={steps}", f"run.output_dir={tmp / name}"]
    sets += [f'reward.functions=["{tmp / "reward.py"}:hashed"]', *extra]
    argv = ["train", str(CONFIG), *[x for s in sets for x in ("--set", s)]]
    return argv + (["--resume"] if resume else ["--overwrite"])


def _cli(tmp: Path, name: str, steps: int, *extra: str, resume: bool = False, **opts) -> dict:
    return {
        "kind": "cli",
        "argv": _argv(tmp, name, steps, *extra, resume=resume),
        "record": str(tmp / f"rec-{name}"),
        **opts,
    }


def _launch(
    tmp: Path, nproc: int, jobs: list[dict], tag: str, timeout: float = 300
) -> tuple[int, str, float]:
    spec = tmp / f"spec-{tag}.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    t = time.perf_counter()
    p = subprocess.run(
        [*cmd, str(DRIVER), str(spec)], capture_output=True, text=True, env=env, cwd=tmp, timeout=timeout
    )
    return p.returncode, p.stdout + p.stderr, time.perf_counter() - t


def _records(tmp: Path, name: str, ws: int) -> list[dict]:
    return [json.loads((tmp / f"rec-{name}" / f"rank{r}.json").read_text()) for r in range(ws)]


def _steps(run: Path) -> dict[int, dict]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "optimizer_steps" in r:
            out[r["step"]] = r
    return out


def _untimed(rows: dict[int, dict]) -> dict[int, dict]:
    return {
        s: {k: v for k, v in r.items() if not (k.startswith("perf/") or k.endswith("_s") or "time" in k)}
        for s, r in rows.items()
    }


def _policy(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:06d}" / "policy" / "model.safetensors"))


def _assert_exact(run: Path, steps: int) -> dict[int, dict]:
    rows = _steps(run)
    assert sorted(rows) == list(range(1, steps + 1))
    for s, m in rows.items():
        # The guard's count is over every rank's tokens: all the step's completion tokens were checked.
        assert (
            m["mismatch/num_tokens"]
            == m["mismatch/completion_tokens"]
            == round(m["response_length/mean"] * 16)
        )
        assert m["mismatch/num_tokens"] > 0 and m["mismatch/num_mismatched_tokens"] == 0, s
        assert m["optimizer_steps"] == 1.0, s
    summary = json.loads((run / "summary.json").read_text())
    assert summary["mismatched_tokens_total"] == 0 and summary["rl_steps"] == steps
    return rows


@pytest.fixture(scope="module")
def ws2(tmp_path_factory) -> Path:
    """One launch at world size 2: a 3-step bf16 run, then the same run with a fault planted on rank 1 (the
    launch's last job: it ends the launch, with an error on every rank)."""
    tmp = tmp_path_factory.mktemp("offdist2")
    (tmp / "reward.py").write_text(REWARD)
    jobs = [
        _cli(tmp, "k1", 3, BF16, save_weights=str(tmp / "replica"), slow_worker=1.0),
        # Rank 1's generate calls: 1 = step 1's batch (main thread), 2 = step 2's batch (its worker, during step 1's
        # update). Rank 0 alone evaluates, so the plant is on the other rank than the one that writes and logs.
        _cli(tmp, "fault", 3, BF16, plant_ulp=[1, 2]),
    ]
    code, out, secs = _launch(tmp, 2, jobs, "ws2")
    print(f"world size 2 launch: exit {code} after {secs:.1f} s")
    (tmp / "ws2.log").write_text(out)
    assert code != 0, "the fault job must fail the launch"
    assert _records(tmp, "k1", 2)[0]["error"] is None, out[-6000:]
    assert (tmp / "rec-fault" / "rank1.json").is_file(), out[-6000:]
    return tmp


def test_one_step_off_at_world_size_2_is_exact_and_one_version_behind(ws2):
    rows = _assert_exact(ws2 / "k1", 3)
    assert [rows[s]["offpolicy/versions_behind/token_mean"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [rows[s]["offpolicy/versions_behind/max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert [rows[s]["offpolicy/behaviour_version"] for s in (1, 2, 3)] == [0.0, 0.0, 1.0]
    # Step 1 trains on a batch of its own weights: the FSDP2 forward (all-gathered fp32 shards cast to bf16)
    # gives the logprobs the replica recorded and the guard scored, bit for bit (pi_prox / pi_behav == 1 exactly
    # on every token). Later batches are really stale: the ratio moves (the negative control).
    assert rows[1]["offpolicy/is_weight/mean"] == rows[1]["offpolicy/is_weight/max"] == 1.0
    assert all(rows[s]["offpolicy/is_weight/max"] != 1.0 for s in (2, 3))
    # The weight sync after each step is the replica's refresh (once a step, the whole model).
    assert all(rows[s]["weight_sync/bytes"] > 0 for s in (1, 2, 3))
    # Each rank's pending batch travels with every checkpoint but the last (nothing is pending after it).
    ck = ws2 / "k1" / "checkpoints"
    for s in (1, 2):
        assert sorted(p.name for p in (ck / f"step-{s:06d}" / "offpolicy_pending").iterdir()) == [
            "rank0-of-2",
            "rank1-of-2",
        ]
    assert not (ck / "step-000003" / "offpolicy_pending").exists()


def test_the_replica_is_the_behaviour_copy_and_holds_its_version(ws2):
    for rec in _records(ws2, "k1", 2):
        assert rec["replica_behaviour"] and rec["engine_is_behaviour"] and rec["sync_targets_engine"], rec
        # The trainer's (sharded) policy and the replica: no third copy of the model.
        assert rec["models"] == 2, rec
        steps = rec["steps"]
        assert sorted(steps) == ["1", "2", "3"]
        assert [steps[s]["version"] for s in ("1", "2", "3")] == [0, 0, 1]
        # The replica did not change while the worker sampled (the sync waits for the worker to join).
        assert all(st["start"] == st["end"] for st in steps.values()), steps
        assert steps["1"]["start"] == steps["2"]["start"] != steps["3"]["start"]
    # Every rank's replica holds the same bits.
    a, b = _records(ws2, "k1", 2)
    assert all(a["steps"][s]["start"] == b["steps"][s]["start"] for s in ("1", "2", "3"))
    # Step 3's batch was sampled by version 1: the weights of the checkpoint after step 1 (written from the replica).
    held = torch.load(ws2 / "replica" / "step3.pt")
    saved = _policy(ws2 / "k1", 1)
    names = [k for k in saved if k in held]
    assert names and all(torch.equal(saved[k], held[k]) for k in names)
    first = torch.load(ws2 / "replica" / "step1.pt")
    assert any(not torch.equal(first[k], held[k]) for k in names)  # the policy moved


def test_a_fault_on_one_rank_stops_every_rank_before_the_update(ws2):
    recs = _records(ws2, "fault", 2)
    for rec in recs:
        # Every rank refused step 2 (agreed), naming rank 1's first differing token; none hung or trained on it.
        assert rec["error_type"] == "MismatchError", rec
        assert "step 2" in rec["error"] and "no optimizer step was applied" in rec["error"], rec["error"]
        assert "on rank 1" in rec["error"] and "behaviour weights" in rec["error"] and "0x" in rec["error"]
        assert "completion position 0" in rec["error"]
        assert rec["adam_steps"] == 1.0, rec  # step 1's update only: step 2's was never applied
    run = ws2 / "fault"
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000001"
    assert sorted(_steps(run)) == [1]
    # The replay report (written by rank 0) holds rank 1's offending sequence.
    report = json.loads((run / "mismatch-000002" / "report.json").read_text())
    assert report["step"] == 2 and len(report["sequences"]) == 1
    assert not (run / "summary.json").exists()


# ----------------------------------------------------------------------------------------------------------
# Slow: resume, skip_step, a failing worker, k = 0, world size 4
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def more(ws2) -> Path:
    tmp = ws2
    jobs = [
        {"kind": "crash_copy", "src": str(tmp / "k1"), "dst": str(tmp / "r22"), "step": 2},
        {"kind": "crash_copy", "src": str(tmp / "k1"), "dst": str(tmp / "r21"), "step": 2},
        _cli(tmp, "r22", 3, BF16, resume=True),
        _cli(tmp, "skip", 3, BF16, "run.on_mismatch=skip_step", plant_ulp=[1, 2]),
        _cli(tmp, "k0", 2, BF16, "algorithm.max_off_policy_steps=0", refuse_offpolicy=True),
        # LoRA: the sync moves the adapters alone; the reference is the base with the adapters off.
        _cli(tmp, "lora", 2, "lora.rank=4", "algorithm.kl_coef=0.05"),
        # Rank 1's worker raises while sampling step 2's batch (during step 1's update): the launch's last job.
        _cli(tmp, "wfail", 3, worker_fail=[1, 2]),
    ]
    code, out, secs = _launch(tmp, 2, jobs, "ws2-more")
    (tmp / "ws2-more.log").write_text(out)
    print(f"world size 2 launch (more): exit {code} after {secs:.1f} s")
    assert code != 0, "the failing worker must fail the launch"
    assert (tmp / "rec-k0" / "rank0.json").is_file(), out[-6000:]  # the jobs before it ran
    code, out, secs = _launch(tmp, 1, [_cli(tmp, "r21", 3, BF16, resume=True)], "ws1-resume")
    assert code == 0, out[-6000:]
    (tmp / "ws1-resume.log").write_text(out)
    return tmp


@pytest.mark.slow
def test_resume_at_world_size_2_is_bitwise(more):
    """Crashed after step 2's checkpoint, resumed at world size 2: step 3 trains on the batch each rank's share of
    the checkpoint holds (sampled by version 1), metrics and weights bitwise the uninterrupted run's."""
    a, b = _untimed(_steps(more / "k1")), _untimed(_steps(more / "r22"))
    assert sorted(b) == [1, 2, 3] and a == b
    x, y = _policy(more / "k1", 3), _policy(more / "r22", 3)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    assert (
        "trains on the batch the checkpoint holds (sampled by version 1)"
        in (more / "ws2-more.log").read_text()
    )


@pytest.mark.slow
def test_resume_at_world_size_1_splits_the_pending_batch(more):
    """The same crash resumed on one rank: the two ranks' pending shares are joined (same batch, same advantages);
    the step agrees with the uninterrupted world-size-2 run up to the gradient reduction's rounding."""
    log = (more / "ws1-resume.log").read_text()
    assert "sampled on 2 ranks, is split over 1 by prompt groups" in log
    a, b = _steps(more / "k1")[3], _steps(more / "r21")[3]
    assert b["mismatch/num_mismatched_tokens"] == 0 and b["offpolicy/behaviour_version"] == 1.0
    for k in ("reward/mean", "num_tokens", "mismatch/num_tokens"):
        assert a[k] == b[k], k
    for k in ("loss", "grad_norm", "entropy"):
        assert abs(a[k] - b[k]) <= 1e-2 * max(abs(a[k]), 1e-6), (k, a[k], b[k])


@pytest.mark.slow
def test_skip_step_is_agreed_over_the_ranks(more):
    rows = _steps(more / "skip")
    assert sorted(rows) == [1, 2, 3]
    # Rank 1's one-ulp fault, counted over every rank's tokens, dropped step 2 on both ranks (rank 0's own tokens
    # were all equal): no optimizer step there; the others trained.
    assert rows[2]["mismatch/step_skipped"] == 1 and rows[2]["optimizer_steps"] == 0
    assert rows[2]["mismatch/num_mismatched_tokens"] == 1
    assert rows[1]["optimizer_steps"] == rows[3]["optimizer_steps"] == 1
    assert all(r["error"] is None for r in _records(more, "skip", 2))
    x, y = _policy(more / "skip", 1), _policy(more / "skip", 2)
    assert all(torch.equal(x[k], y[k]) for k in x)  # step 2 changed nothing


@pytest.mark.slow
def test_a_failing_worker_on_one_rank_stops_every_rank_with_its_error(more):
    # Every rank left through the error (none was killed in a collective, which writes no record).
    assert all((more / "rec-wfail" / f"rank{r}.json").is_file() for r in (0, 1)), (
        more / "ws2-more.log"
    ).read_text()[-4000:]
    for rec in _records(more, "wfail", 2):
        assert rec["error_type"] == "WorkerFailed", rec
        assert "failed on rank 1" in rec["error"], rec["error"]
        assert "planted worker failure on rank 1 sampling step 2" in rec["error"], rec["error"]
    assert not (more / "wfail" / "summary.json").exists()


@pytest.mark.slow
def test_k0_under_torchrun_never_touches_the_off_policy_machinery(more):
    rows = _steps(more / "k0")
    assert sorted(rows) == [1, 2]
    assert all(m["mismatch/num_mismatched_tokens"] == 0 < m["mismatch/num_tokens"] for m in rows.values())
    assert not any(k.startswith("offpolicy/") for m in rows.values() for k in m)
    assert all(r["error"] is None for r in _records(more, "k0", 2))


@pytest.mark.slow
def test_one_step_off_with_lora_at_world_size_2(more):
    rows = _assert_exact(more / "lora", 2)
    assert rows[2]["offpolicy/versions_behind/token_mean"] == 1.0
    full = _steps(more / "k1")[1]["weight_sync/bytes"]
    assert all(0 < m["weight_sync/bytes"] < full / 5 for m in rows.values())  # the adapters alone travel
    assert (more / "lora" / "checkpoints" / "step-000001" / "adapter" / "adapter_config.json").is_file()
    assert (more / "lora" / "checkpoints" / "step-000001" / "offpolicy_pending" / "rank1-of-2").is_dir()


@pytest.mark.slow
def test_one_step_off_at_world_size_4(tmp_path):
    (tmp_path / "reward.py").write_text(REWARD)
    ppo = str(ROOT / "configs" / "quickstart-ppo.toml")
    jobs = [_cli(tmp_path, "g4", 3)]
    ppo_job = _cli(tmp_path, "p4", 2)
    ppo_job["argv"][1] = ppo
    jobs.append(ppo_job)
    code, out, secs = _launch(tmp_path, 4, jobs, "ws4")
    print(f"world size 4 launch: exit {code} after {secs:.1f} s")
    assert code == 0, out[-6000:]
    rows = _assert_exact(tmp_path / "g4", 3)
    assert [rows[s]["offpolicy/versions_behind/token_mean"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert rows[1]["offpolicy/is_weight/mean"] == rows[1]["offpolicy/is_weight/max"] == 1.0
    p = _assert_exact(tmp_path / "p4", 2)
    assert p[2]["offpolicy/versions_behind/token_mean"] == 1.0
    for rec in _records(tmp_path, "g4", 4):
        assert rec["replica_behaviour"] and rec["models"] == 2
        assert [rec["steps"][s]["version"] for s in ("1", "2", "3")] == [0, 0, 1]


def test_the_memory_plan_counts_no_third_copy_under_torchrun():
    """The memory plan of a one-step-off run: a behaviour copy on one device; under torchrun the engine replica the
    synchronous run holds anyway, and nothing more (the replica is the copy)."""
    from exactrl.config import apply_overrides, config_from_dict
    from exactrl.train.memory import GiB, plan_memory

    def terms(k: int, ws: int) -> dict[str, int]:
        cfg = config_from_dict({"model": {"preset": "tiny", "dtype": "bfloat16"}})
        cfg = apply_overrides(cfg, [f"algorithm.max_off_policy_steps={k}"])
        cfg.validate()
        return plan_memory(cfg, world_size=ws, gpu_memory=80 * GiB, device="cuda").phase("training").terms

    assert "behaviour_copy" in terms(1, 1) and "behaviour_copy" not in terms(0, 1)
    assert terms(1, 2) == terms(0, 2) and terms(1, 2)["engine_replica"] > 0
