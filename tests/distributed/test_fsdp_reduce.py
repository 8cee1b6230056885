"""train.fsdp_reduce: FSDP2 reduce-scatters a minibatch's gradients once, after its last microbatch ("minibatch",
the default: every rank accumulates the whole model's fp32 gradients unsharded until then), or after every
microbatch ("microbatch": the shards accumulate, 1/N of that memory; what qwen3-30b-a3b needs on 2 x H200, where
the unsharded accumulation ran a rank out of memory). One gloo rank in this process: the trainer asks FSDP2 for
the sync it is configured for, microbatch by microbatch, and stays exact either way."""

from __future__ import annotations

import pytest
import torch

from exactrl.config import load_config
from exactrl.distributed.parallelize import Parallelism
from exactrl.model import build_model, preset
from exactrl.train.loop import trainer_settings
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import completion_logprobs
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings

from ._runs import ROOT


def _rollouts(model) -> list[Rollout]:
    g = torch.Generator().manual_seed(2)
    out = []
    for i in range(6):
        p = torch.randint(1, 60, (3 + i,), generator=g).tolist()
        c = torch.randint(1, 60, (2 + (5 * i) % 7,), generator=g).tolist()
        out.append(Rollout(p, c, torch.zeros(len(c)), advantage=float(i % 3) - 1.0))
    lps = completion_logprobs(
        model, [r.prompt_ids + r.completion_ids for r in out], [len(r.prompt_ids) for r in out]
    )
    for r, lp in zip(out, lps):
        r.rollout_logprobs = lp
    return out


@pytest.mark.parametrize(("every", "want"), [(False, [False, False, True]), (True, [True, True, True])])
def test_the_trainer_reduces_per_minibatch_or_per_microbatch(
    one_gloo_rank, every: bool, want: list[bool]
) -> None:
    model = build_model(preset("tiny", num_layers=2), seed=1)
    model.init_weights(seed=3, std=0.05)  # trained-looking: not the first init's values
    rollouts = _rollouts(model)
    Parallelism(one_gloo_rank).parallelize(model)
    asked: list[bool] = []
    model.set_requires_gradient_sync = asked.append  # the FSDP2 module's switch, recorded
    settings = TrainerSettings(max_tokens_per_microbatch=20, reduce_every_microbatch=every)
    trainer = PolicyTrainer(
        model, settings, MasterAdamW(model, lr=1e-3, dist=one_gloo_rank), dist=one_gloo_rank
    )
    m = trainer.step(rollouts)
    n = len(asked)
    assert n >= 3 and m["perf/train_microbatches"] == n
    assert asked == [every] * (n - 1) + [True]  # the last microbatch reduces either way
    assert m["mismatch/num_mismatched_tokens"] == 0 and m["mismatch/num_tokens"] > 0


def test_the_config_key_reaches_the_trainer() -> None:
    quick = ROOT / "configs" / "quickstart.toml"
    assert not trainer_settings(load_config(quick)).reduce_every_microbatch
    assert trainer_settings(load_config(quick, ["train.fsdp_reduce=microbatch"])).reduce_every_microbatch
