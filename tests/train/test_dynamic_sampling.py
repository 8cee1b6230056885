"""Dynamic sampling (exactrl/train/dynamic_sampling.py), first on its own with made-up rounds (which groups are kept,
dropped, padded; what is drawn), at world size 1 and 2 (two threads standing in for two ranks), then in runs: the
trainer sees only groups with signal, every kept token is checked by the guard, one-step-off never holds a dropped
group, and a resume after steps that resampled is bitwise the uninterrupted run."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from exactrl.config import ConfigError, config_from_dict
from exactrl.tasks.rewards import RewardResult
from exactrl.train.drivers.modes import choose_driver
from exactrl.train.dynamic_sampling import (
    DynamicSampler,
    has_signal,
    next_draw,
    request_id_base,
)

G = 2  # group size of the made-up rounds


# -- made-up rounds ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class FakeShare:
    """What the loop's RankScores holds, for made-up groups: a rollout is its (round, prompt, sample) label."""

    rollouts: list[Any]
    rewards: RewardResult
    completions: list[str]
    answers: list[str]
    refused: int = 0


class FakeDist:
    """`DistContext`'s collectives for `world` threads, one per rank (all_gather_object through a barrier)."""

    def __init__(self, rank: int, world: int, board: dict, barrier: threading.Barrier | None) -> None:
        self.rank, self.world_size, self.distributed = rank, world, world > 1
        self.board, self.barrier = board, barrier

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.barrier is None:
            return [obj]
        self.barrier.wait()
        self.board[self.rank] = obj
        self.barrier.wait()
        out = [self.board[r] for r in range(self.world_size)]
        self.barrier.wait()
        return out

    def shard(self, n: int) -> range:
        base, extra = divmod(n, self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (self.rank < extra))


def rounds_from(table: list[list[list[float]]]):
    """draw/sample callables over `table[round][prompt]` = that prompt's rewards (a round draws as many prompts as
    asked; the table must hold them). Records the counts drawn."""
    drawn: list[int] = []

    def make(dist: FakeDist):
        def draw(count: int):
            drawn.append(count)
            mine = list(dist.shard(count))
            return [None] * len(mine), [[0]] * len(mine), mine

        def sample(round_: int, d) -> FakeShare:
            index = d[2]
            rows = table[round_]
            labels = [(round_, i, j) for i in index for j in range(G)]
            rewards = [v for i in index for v in rows[i]]
            correct = [v > 0.5 for v in rewards]
            res = RewardResult(rewards, {"fn": list(rewards)}, {"fn": round_}, {}, correct=correct)
            return FakeShare(labels, res, [str(x) for x in labels], ["a"] * len(labels))

        return draw, sample

    return make, drawn


def collect(table, target: int, max_rounds: int, world: int = 1, metric: str = "reward"):
    """Run `DynamicSampler.collect` over the table on `world` ranks; every rank's (share, metrics)."""
    make, drawn = rounds_from(table)
    board: dict = {}
    barrier = threading.Barrier(world) if world > 1 else None
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            dist = FakeDist(rank, world, board, barrier)
            draw, sample = make(dist)
            first = (
                [None] * len(dist.shard(target)),
                [[0]] * len(dist.shard(target)),
                list(dist.shard(target)),
            )
            ds = DynamicSampler(metric, G, target, max_rounds, dist, out=lambda *_: None)
            results[rank] = ds.collect(0, first, draw, sample)
        except BaseException as e:  # noqa: BLE001 - reraised in the test's thread
            errors.append(e)
            if barrier is not None:
                barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, drawn


def kept_groups(share: FakeShare) -> list[tuple[int, int]]:
    return [(r, i) for (r, i, j) in share.rollouts if j == 0]


# Round 0: 4 prompts, two with signal (1 and 3). Round 1 (2 drawn at the rate seen): one more with signal (its 0).
TABLE = [
    [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [0.5, 0.0]],
    [[0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [0.0, 1.0]],
    [[0.0, 1.0]] * 4,
]


def test_signal_is_any_difference():
    assert not has_signal([1.0, 1.0, 1.0]) and not has_signal([0.0]) and not has_signal([0.25, 0.25])
    assert has_signal([0.0, 1.0]) and has_signal([1.0, 1.0, 0.0]) and has_signal([0.0, 1.0, 0.0])
    assert has_signal([0.5, 0.5, 0.5, 0.5 + 2**-20])  # exact: no tolerance hides a real difference


def test_keeps_exactly_the_groups_with_signal_in_draw_order():
    [(share, m)], drawn = collect(TABLE, target=4, max_rounds=3)
    assert kept_groups(share) == [(0, 1), (0, 3), (1, 0), (1, 2)]
    assert share.rewards.rewards == [0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert share.rewards.per_function["fn"] == share.rewards.rewards
    assert share.rewards.correct == [False, True, False, False, False, True, False, True]
    assert share.completions == [str(x) for x in share.rollouts]
    assert drawn == [4]  # round 1: 2 missing at a rate of 2 in 4 -> 4 prompts
    assert share.rewards.num_errors == {"fn": 0 + 1}  # every round's failures counted, kept or not
    assert m == {
        "dynamic_sampling/prompts_drawn": 8.0,
        "dynamic_sampling/extra_rounds": 1.0,
        "dynamic_sampling/groups_dropped": 3.0,
        "dynamic_sampling/groups_kept": 4.0,
        "dynamic_sampling/groups_surplus": 1.0,  # round 1's prompt 3: beyond the step's 4
        "dynamic_sampling/groups_padded": 0.0,
        "dynamic_sampling/groups_missing": 0.0,
    }


def test_a_full_first_round_draws_nothing_more():
    [(share, m)], drawn = collect([[[0.0, 1.0]] * 4], target=4, max_rounds=3)
    assert kept_groups(share) == [(0, 0), (0, 1), (0, 2), (0, 3)] and drawn == []
    assert m["dynamic_sampling/extra_rounds"] == 0 and m["dynamic_sampling/groups_dropped"] == 0


def test_the_cap_trains_on_what_there_is_and_says_so():
    flat = [[[1.0, 1.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0]] * 4, [[0.0, 0.0]] * 4]
    [(share, m)], drawn = collect(flat, target=4, max_rounds=1)
    assert kept_groups(share) == [(0, 1)] and drawn == [4]
    assert m["dynamic_sampling/groups_missing"] == 3.0 and m["dynamic_sampling/extra_rounds"] == 1.0
    # Nothing with signal at all: one group without it is trained on (zero advantages), never an empty step.
    [(share, m)], _ = collect([[[1.0, 1.0]] * 4], target=4, max_rounds=0)
    assert kept_groups(share) == [(0, 0)] and m["dynamic_sampling/groups_padded"] == 1.0
    assert m["dynamic_sampling/groups_missing"] == 4.0


def test_accuracy_filters_on_the_verdict_not_the_reward():
    # Rewards differ (0.6 vs 0.9) but both are correct: no signal in accuracy, signal in reward.
    table = [[[0.6, 0.9], [0.0, 1.0]], [[0.0, 1.0]] * 2]
    [(share, _)], _ = collect(table, target=2, max_rounds=1, metric="accuracy")
    assert kept_groups(share) == [(0, 1), (1, 0)]
    [(share, _)], _ = collect(table, target=2, max_rounds=1, metric="reward")
    assert kept_groups(share) == [(0, 0), (0, 1)]


def test_two_ranks_keep_the_groups_one_rank_keeps():
    """The decision is global: rank 0 and rank 1 together train on exactly the groups of world size 1, in the same
    order, each its contiguous block, whichever rank sampled them; the metrics agree on every rank."""
    [(one, m1)], _ = collect(TABLE, target=4, max_rounds=3)
    two, _ = collect(TABLE, target=4, max_rounds=3, world=2)
    assert kept_groups(two[0][0]) + kept_groups(two[1][0]) == kept_groups(one)
    assert kept_groups(two[0][0]) == [(0, 1), (0, 3)] and kept_groups(two[1][0]) == [(1, 0), (1, 2)]
    assert two[0][0].rewards.rewards + two[1][0].rewards.rewards == one.rewards.rewards
    assert two[0][1] == two[1][1] == m1
    # Short at world size 2: padded to one group per rank, so that no rank has nothing to train on.
    two, _ = collect([[[0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]], target=4, max_rounds=0, world=2)
    assert kept_groups(two[0][0]) == [(0, 0)] and kept_groups(two[1][0]) == [(0, 1)]
    assert two[0][1]["dynamic_sampling/groups_padded"] == 1.0


def test_next_draw_and_request_ids():
    assert next_draw(2, 4, 2, 8, 1) == 4  # 2 missing at a rate of one in two
    assert next_draw(2, 4, 0, 8, 1) == 8  # no signal seen yet: a whole step's draw
    assert next_draw(1, 8, 8, 8, 2) == 2  # at least one prompt per rank
    assert next_draw(7, 8, 1, 8, 1) == 8  # at most a step's draw
    # Round 0 is the step's usual ids; later rounds never meet another step's or round's.
    assert request_id_base(5, 0, 16) == 5 * 16
    ids = {request_id_base(s, r, 16) + i for s in range(50) for r in range(4) for i in range(16)}
    assert len(ids) == 50 * 4 * 16


# -- config -----------------------------------------------------------------------------------------------------------
BASE: dict[str, dict[str, Any]] = {
    "run": {
        "name": "ds",
        "seed": 0,
        "device": "cpu",
        "tensorboard": False,
        "report": False,
        "progress": False,
    },
    "model": {"preset": "tiny", "dtype": "float32"},
    "engine": {"block_size": 16, "max_model_len": 64},
    "sampling": {"temperature": 1.0, "max_tokens": 4},
    "task": {
        "name": "arithmetic",
        "arithmetic_max_operand": 30,
        "use_chat_template": False,
        "num_eval": 4,
        "eval_every": 0,
        "max_prompt_tokens": 16,
    },
    "reward": {"functions": ["numeric_match"]},
    "algorithm": {"name": "grpo", "group_size": 2, "rollouts_per_step": 8, "dynamic_sampling": "reward"},
    "train": {"steps": 3, "lr": 3e-4, "save_every": 1},
    "sft": {"steps": 0},
}


def _cfg(out: Path | None = None, **over: Any):
    d = json.loads(json.dumps(BASE))
    for key, value in over.items():
        section, name = key.split("__")
        d.setdefault(section, {})[name] = value
    if out is not None:
        d["run"]["output_dir"] = str(out)
    return config_from_dict(d)


@pytest.mark.parametrize(
    "over,key",
    [
        ({"algorithm__advantage": "gae"}, "algorithm.advantage"),
        ({"algorithm__advantage": "remax"}, "algorithm.advantage"),
        ({"algorithm__advantage": "reinforce_plus_plus"}, "algorithm.advantage"),
        ({"algorithm__overlap": "tail"}, "algorithm.overlap"),
        (
            {"algorithm__partial_rollouts": True, "algorithm__max_off_policy_steps": 2},
            "algorithm.partial_rollouts",
        ),
        (
            {"algorithm__dynamic_sampling": "accuracy", "reward__accuracy": "off"},
            "algorithm.dynamic_sampling",
        ),
        ({"algorithm__dynamic_sampling_max_rounds": -1}, "algorithm.dynamic_sampling_max_rounds"),
        ({"reward__overlong_buffer_tokens": 4}, "reward.overlong_buffer_tokens"),
        ({"reward__overlong_penalty": -1.0}, "reward.overlong_penalty"),
    ],
)
def test_unsupported_combinations_are_refused_by_name(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _cfg(**over).validate()


def test_accepted_combinations():
    for over in (
        {"algorithm__name": "dr_grpo"},
        {"algorithm__name": "rloo"},
        {"algorithm__max_off_policy_steps": 1},
        {"reward__overlong_buffer_tokens": 2, "algorithm__overlong_filter": True},
        {"algorithm__dynamic_sampling": "accuracy"},
    ):
        _cfg(**over).validate()
    cfg = _cfg(algorithm__max_off_policy_steps=1)
    assert choose_driver(cfg, distributed=False, moe=False) == "one_step_off"
    with pytest.raises(ValueError, match="torchrun"):
        choose_driver(cfg, distributed=True, moe=False)


# -- runs ---------------------------------------------------------------------------------------------------------------
# A reward of 1 with probability 1/4 (a hash of the completion): most groups of two are all equal, so steps resample.
COIN = """
import hashlib

def coin(completion, answer, example):
    return float(int(hashlib.sha256(completion.encode()).hexdigest(), 16) % 4 == 0)
"""

# The same coin for multi-turn episodes: one model turn, scored by the environment.
COIN_ENV = """
import hashlib

from exactrl.envs import Environment, StepResult


class Coin(Environment):
    def reset(self, example):
        pass

    def step(self, turn):
        h = int(hashlib.sha256(bytes(t % 256 for t in turn.token_ids)).hexdigest(), 16)
        return StepResult(done=True, reward=float(h % 4 == 0))
"""


@pytest.fixture(autouse=False)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run_cfg(tmp_path: Path, name: str, **over: Any):
    (tmp_path / "coin.py").write_text(COIN)
    (tmp_path / "coin_env.py").write_text(COIN_ENV)
    over = {"reward__functions": [f"{tmp_path / 'coin.py'}:coin"], "train__keep_checkpoints": 5, **over}
    cfg = _cfg(tmp_path / name, **over)
    cfg.validate()
    return cfg


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "optimizer_steps" in r]


def _untimed(rows: list[dict]) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not (k.startswith("perf/") or k.endswith("_s") or "time" in k)}
        for r in rows
    ]


@pytest.mark.parametrize(
    "mode,over",
    [
        ("sync", {}),
        ("one_step_off", {"algorithm__max_off_policy_steps": 1}),
        (
            "multi_turn",
            {"env__name": "coin_env:Coin", "env__max_turns": 1, "reward__functions": ["numeric_match"]},
        ),
        (
            "multi_turn_one_step_off",
            {
                "env__name": "coin_env:Coin",
                "env__max_turns": 1,
                "reward__functions": ["numeric_match"],
                "algorithm__max_off_policy_steps": 1,
            },
        ),
    ],
)
def test_the_trainer_sees_only_groups_with_signal(tmp_path, monkeypatch, one_thread, mode, over):
    """Every group the trainer steps on has rewards that differ; the step holds the asked number of groups (or says
    what it lacked); the guard compared every token of them; extra rounds' requests never reuse a key."""
    from exactrl.train.loop import train
    from exactrl.train.trainer import PolicyTrainer

    seen: list[list[Any]] = []
    real = PolicyTrainer.step

    def record(self, rollouts, **kw):
        seen.append(list(rollouts))
        return real(self, rollouts, **kw)

    monkeypatch.setattr(PolicyTrainer, "step", record)
    # The environment's module is imported by name, from the working directory.
    if mode.startswith("multi_turn"):
        monkeypatch.chdir(tmp_path)
    train(_run_cfg(tmp_path, "run", **over), out=lambda *_: None)
    rows = _steps(tmp_path / "run")
    assert len(seen) == len(rows) == 3
    keys = set()
    for rollouts, row in zip(seen, rows):
        groups = [rollouts[i : i + G] for i in range(0, len(rollouts), G)]
        assert all(has_signal([ro.reward for ro in g]) for g in groups), mode
        assert len(groups) == 4 - row["dynamic_sampling/groups_missing"]
        assert row["dynamic_sampling/groups_kept"] == len(groups)
        assert row["mismatch/num_tokens"] == sum(len(ro.completion_ids) for ro in rollouts)
        assert row["mismatch/num_mismatched_tokens"] == 0
        for ro in rollouts:
            key = (ro.request_id, ro.sample_index)
            assert key not in keys
            keys.add(key)
    assert sum(r["dynamic_sampling/groups_dropped"] for r in rows) > 0
    assert sum(r["dynamic_sampling/extra_rounds"] for r in rows) > 0
    assert any(
        ro.request_id >= request_id_base(0, 1, 4) for rs in seen for ro in rs
    )  # a later round's sample trained


def test_resume_after_resampled_steps_is_bitwise(tmp_path, one_thread):
    """Steps 1 and 2 resampled; a run stopped after step 2 and resumed ends with the uninterrupted run's records and
    weights, bit for bit, and each checkpoint's data position is the prompts drawn so far, extra rounds included."""
    from exactrl.train.loop import train

    quiet = lambda *_: None  # noqa: E731
    train(_run_cfg(tmp_path, "whole"), out=quiet)
    train(_run_cfg(tmp_path, "resumed", train__steps=2), out=quiet)
    lines: list[str] = []
    train(_run_cfg(tmp_path, "resumed"), resume=True, out=lines.append)
    assert any("resumed from" in x and "at step 2" in x for x in lines)
    whole, resumed = _steps(tmp_path / "whole"), _steps(tmp_path / "resumed")
    assert _untimed(whole) == _untimed(resumed)
    # The summary's dynamic-sampling totals are the whole run's after a resume (kept in the checkpoint's totals).
    sw, sr = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("whole", "resumed"))
    totals = {k: v for k, v in sw.items() if k.startswith("dynamic_sampling_")}
    assert totals["dynamic_sampling_prompts_drawn_total"] == sum(
        r["dynamic_sampling/prompts_drawn"] for r in whole
    )
    assert totals == {k: v for k, v in sr.items() if k.startswith("dynamic_sampling_")}
    assert all(
        r["dynamic_sampling/extra_rounds"] > 0 for r in whole[:2]
    )  # the resume point follows resampled steps
    drawn = 0
    for r in whole:
        drawn += r["dynamic_sampling/prompts_drawn"]
        state = json.loads(
            (tmp_path / "whole" / "checkpoints" / f"step-{r['step']:06d}" / "state.json").read_text()
        )
        assert state["task"]["position"] == drawn
    ckpt = "checkpoints/step-000003/policy/model.safetensors"
    wa, wb = load_file(str(tmp_path / "whole" / ckpt)), load_file(str(tmp_path / "resumed" / ckpt))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_dapo_recipe(tmp_path, one_thread):
    """configs/quickstart-dapo.toml shrunk: DAPO's four parts set, a run that drops, resamples and penalises."""
    from exactrl.config import load_config
    from exactrl.train.loop import train

    (tmp_path / "coin.py").write_text(COIN)
    root = Path(__file__).resolve().parents[2]
    cfg = load_config(
        root / "configs" / "quickstart-dapo.toml",
        [
            f"run.output_dir={tmp_path / 'run'}",
            "run.progress=false",
            "run.tensorboard=false",
            "run.report=false",
            "train.steps=2",
            "train.warmup_steps=0",
            "sft.steps=0",
            "algorithm.rollouts_per_step=8",
            "algorithm.group_size=2",
            "task.num_eval=4",
            "task.eval_every=0",
            "sampling.temperature=1.0",
            f'reward.functions=["{tmp_path / "coin.py"}:coin"]',  # the verdict reward.accuracy finds ("auto")
        ],
    )
    a, r = cfg.algorithm, cfg.reward
    assert (a.eps_low, a.eps_high, a.aggregation) == (0.2, 0.28, "token-mean")
    assert (a.dynamic_sampling, r.overlong_buffer_tokens, cfg.sampling.max_tokens) == ("accuracy", 2, 6)
    lines: list[str] = []
    summary = train(cfg, out=lines.append)
    rows = _steps(tmp_path / "run")
    assert summary["mismatched_tokens_total"] == 0 and len(rows) == 2
    assert sum(x["dynamic_sampling/groups_dropped"] for x in rows) > 0
    # The algorithm as configured, the run's dynamic-sampling totals, and each step line's groups and rounds.
    assert summary["algorithm"] == (
        "grpo + clip-higher (0.28), dynamic sampling (accuracy), overlong penalty (2 tokens)"
    )
    for key in ("prompts_drawn", "extra_rounds", "groups_dropped", "groups_kept", "groups_missing"):
        assert summary[f"dynamic_sampling_{key}_total"] == sum(x[f"dynamic_sampling/{key}"] for x in rows), (
            key
        )
    step_lines = [x for x in lines if x.startswith("step ")]
    assert len(step_lines) == 2, lines
    for x, row in zip(step_lines, rows):
        kept, dropped = int(row["dynamic_sampling/groups_kept"]), int(row["dynamic_sampling/groups_dropped"])
        assert (
            f"| groups kept {kept} dropped {dropped} (+{int(row['dynamic_sampling/extra_rounds'])} rounds)"
            in x
        )
    assert all(x["overlong/penalized_samples"] > 0 for x in rows)  # a random model runs to the limit
