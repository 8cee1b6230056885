"""One-step-off RL under torchrun (algorithm.max_off_policy_steps = 1) on CPU ranks (gloo), launched as
`python -m torch.distributed.run --standalone` subprocesses of `_offdist_driver.py`.

Without a launch: the guard's metrics merged over the ranks, its verdict and a worker's failure agreed from the
other ranks' answers, the pending batch's shares loaded as saved or split again by prompt groups, the memory plan.

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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exactrl.distributed.env import DistContext

from ._runs import REWARD, launch

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("_offdist_driver.py")
CONFIG = ROOT / "configs" / "quickstart.toml"

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
    "run.report=false",
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
    return launch(DRIVER, tmp, nproc, jobs, tag, timeout)


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


# ----------------------------------------------------------------------------------------------------------
# The pieces, without a launch: what each rank does with the other ranks' answers
# ----------------------------------------------------------------------------------------------------------


class _Ranks(DistContext):
    """Rank `rank` of a run whose other ranks answered `others` (in rank order, this rank's slot left out) to the
    one all-gather the code under test issues."""

    def __init__(self, rank: int, others: list) -> None:
        super().__init__(rank=rank, world_size=len(others) + 1, backend="gloo")
        self.others = others

    def all_gather_object(self, obj):
        parts = list(self.others)
        parts.insert(self.rank, obj)
        return parts


def _rows(seed: int, n: int, width: int, differ: int = 0):
    g = torch.Generator().manual_seed(seed)
    rl = -torch.rand(n, width, generator=g) * 4
    tl = rl.clone()
    mask = torch.arange(width)[None, :] < torch.randint(1, width + 1, (n, 1), generator=g)
    for i in range(differ):  # one ulp off, as a real fault shows
        tl[i, 0] = torch.nextafter(tl[i, 0], torch.tensor(0.0))
    return rl, tl, mask


def test_guard_metrics_merged_over_the_ranks_are_the_whole_batchs():
    from exactrl.algorithms import mismatch_metrics
    from exactrl.train.offpolicy_dist import merge_mismatch_metrics

    a, b = _rows(0, 5, 7, differ=2), _rows(1, 3, 4, differ=1)
    merged = merge_mismatch_metrics([mismatch_metrics(*a), mismatch_metrics(*b)])
    pad = torch.nn.functional.pad
    whole = mismatch_metrics(*[torch.cat([x, pad(y, (0, 3))]) for x, y in zip(a, b)])
    assert merged.keys() == whole.keys()
    for k in ("mismatch/num_tokens", "mismatch/num_mismatched_tokens", "mismatch/logprob_abs_diff_max"):
        assert merged[k] == whole[k], k
    assert merged["mismatch/num_mismatched_tokens"] == 3
    for k in ("mismatch/logprob_abs_diff_mean", "mismatch/token_mult_prob_error", "mismatch/kl_k3"):
        assert merged[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-15), k
    # A rank with no token (the step's groups all on the others) changes nothing.
    empty = mismatch_metrics(torch.zeros(0, 1), torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.bool))
    assert merge_mismatch_metrics([mismatch_metrics(*a), empty]) == mismatch_metrics(*a)
    with pytest.raises(ValueError, match="no rule to combine"):
        merge_mismatch_metrics([{"mismatch/new_metric": 1.0}])


def test_the_guard_verdict_is_every_ranks():
    from exactrl.algorithms import mismatch_metrics
    from exactrl.train.offpolicy_dist import agree_guard
    from exactrl.train.trainer import MismatchError

    clean, bad = mismatch_metrics(*_rows(0, 4, 5)), mismatch_metrics(*_rows(1, 4, 5, differ=1))
    seqs = [(0, 0, torch.zeros(3), torch.ones(3))]
    err = MismatchError("1 of 14 rollout logprobs differ (request 6)", seqs)
    # Rank 0 found nothing, rank 1 did: rank 0 refuses too, naming rank 1's token, with no sequence of its own.
    m0, e0 = agree_guard(_Ranks(0, [(bad, str(err))]), clean, None)
    m1, e1 = agree_guard(_Ranks(1, [(clean, None)]), bad, err)
    assert e0 is not None and e1 is not None and str(e0) == str(e1)
    assert "on rank 1" in str(e0) and "request 6" in str(e0)
    assert e0.sequences == [] and e1.sequences is seqs
    assert m0 == m1 and m0["mismatch/num_mismatched_tokens"] == 1
    # Every rank clean: no error anywhere (the negative control of the two lines above).
    assert agree_guard(_Ranks(0, [(clean, None)]), clean, None)[1] is None


def test_a_failure_on_any_rank_is_raised_on_every_rank():
    from exactrl.train.offpolicy_dist import WorkerFailed, agreed

    assert agreed(_Ranks(0, [None, None]), "sampling", lambda: 7) == 7
    with pytest.raises(WorkerFailed, match=r"sampling failed on rank 2: ValueError: prompt too long"):
        agreed(_Ranks(0, [None, "ValueError: prompt too long"]), "sampling", lambda: 7)

    def fail():
        raise KeyError("boom")

    with pytest.raises(WorkerFailed, match=r"failed on rank 1 \(and on ranks \[2\]\): KeyError") as info:
        agreed(_Ranks(1, [None, "OSError: disk"]), "sampling", fail)
    assert isinstance(info.value.__cause__, KeyError)  # this rank's own error, chained
    with pytest.raises(KeyError):  # one process: the error itself
        agreed(DistContext.single(), "sampling", fail)


def _pending(tmp: Path, ws: int, groups_per_rank: list[int]) -> Path:
    """A checkpoint folder with each rank's share of a pending batch of 2-sample groups, as `save_rank_pending`
    writes it; request ids number the groups in step order."""
    from exactrl.train.loop import StepRollouts
    from exactrl.train.offpolicy import BehaviourBatch
    from exactrl.train.offpolicy_dist import save_rank_pending
    from exactrl.train.trainer import Rollout

    total = sum(groups_per_rank)
    rewards = torch.arange(2 * total, dtype=torch.float32) / 8
    start = 0
    for r in range(ws):
        rollouts, versions = [], []
        for g in range(start, start + groups_per_rank[r]):
            for j in range(2):
                n = 1 + (g + j) % 3
                lp = -torch.rand(n) - 0.5
                rollouts.append(
                    Rollout([1, 2, 3], list(range(4, 4 + n)), lp, request_id=100 + g, sample_index=j)
                )
                versions.append(torch.full((n,), 4, dtype=torch.int64))
        start += groups_per_rank[r]
        sr = StepRollouts(
            rollouts,
            rewards,
            rewards - 1,
            {},
            0,
            [3] * len(rewards),
            [False] * len(rewards),
            {},
            ["c"] * len(rollouts),
            ["a"] * len(rollouts),
        )
        save_rank_pending(tmp, BehaviourBatch(sr, 4, versions, 0.5, 99), r, ws)
    return tmp


def test_pending_shares_load_as_saved_or_split_by_prompt_groups(tmp_path):
    from exactrl.train.loop import StepRollouts
    from exactrl.train.offpolicy_dist import load_any_pending

    d = _pending(tmp_path, 2, [2, 3])
    ids = lambda b: [ro.request_id for ro in b.sr.rollouts]  # noqa: E731
    # The same world size: each rank its own share, bit for bit.
    b1, note = load_any_pending(d, _Ranks(1, [None]), StepRollouts)
    assert note is None and ids(b1) == [102, 102, 103, 103, 104, 104]
    # One rank: the whole batch, in step order; its logprobs and versions travel with their rollouts.
    (whole, note), (own0, _) = (
        load_any_pending(d, DistContext.single(), StepRollouts),
        load_any_pending(d, _Ranks(0, [None]), StepRollouts),
    )
    assert "sampled on 2 ranks, is split over 1" in note and ids(whole) == [
        100 + g for g in range(5) for _ in "ab"
    ]
    assert all(
        torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        for a, b in zip(whole.sr.rollouts, own0.sr.rollouts + b1.sr.rollouts)
    )
    assert [len(v) for v in whole.versions] == [len(ro.completion_ids) for ro in whole.sr.rollouts]
    assert (
        torch.equal(whole.sr.advantages, own0.sr.advantages)
        and whole.version == 4
        and whole.model_tokens == 99
    )
    # Three ranks: whole groups, contiguous, every rank at least one.
    shares = [ids(load_any_pending(d, _Ranks(r, [None, None]), StepRollouts)[0]) for r in range(3)]
    assert shares == [[100, 100, 101, 101], [102, 102, 103, 103], [104, 104]]
    # More ranks than groups: nothing to split, said.
    none, note = load_any_pending(d, _Ranks(0, [None] * 5), StepRollouts)
    assert none is None and "fewer prompt groups than the 6 ranks" in note
    # A share missing (a copy cut short): refused, naming the folder.
    import shutil

    shutil.rmtree(d / "offpolicy_pending" / "rank1-of-2")
    with pytest.raises(ValueError, match="incomplete"):
        load_any_pending(d, _Ranks(0, [None]), StepRollouts)


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
    # What the guard costs, on every rank: its forward over the rank's share (in the worker), the slowest rank's
    # under the metric's name.
    for m in rows.values():
        per_rank = [m["offpolicy/guard_s/rank0"], m["offpolicy/guard_s/rank1"]]
        assert m["offpolicy/guard_s"] == max(per_rank) and min(per_rank) > 0
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
@pytest.mark.extended  # world size 2 (test_one_step_off_at_world_size_2_is_exact_and_one_version_behind) runs by default
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
        # The synchronous run compared keeps its engine memory through training as one step off must
        # (engine.release_memory frees it only when generation and training do not overlap).
        cfg = apply_overrides(cfg, [f"algorithm.max_off_policy_steps={k}", "engine.release_memory=false"])
        cfg.validate()
        return plan_memory(cfg, world_size=ws, gpu_memory=80 * GiB, device="cuda").phase("training").terms

    assert "behaviour_copy" in terms(1, 1) and "behaviour_copy" not in terms(0, 1)
    assert terms(1, 2) == terms(0, 2) and terms(1, 2)["engine_replica"] > 0
