"""Padded training microbatches (the layout the CUDA-graph step replays), on the CPU's exact backend.

Padding must be invisible: its tokens are their own sequences, no loss row reads them, and a completion token's
logprob is the same bits in any bucket (the exact kernels are row-invariant). The trainer's step with padded
buckets must agree with the unpadded one."""

import math

import pytest
import torch

from exactrl.config import AlgorithmConfig
from exactrl.model import build_model, preset
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import (
    PackedBatch,
    TrainMicrobatch,
    choose_bucket,
    completion_logprobs,
    microbatch_logprobs,
    response_logprobs,
)
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings

SEQS = [[3, 4, 5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
PLENS = [2, 1, 4]


def _model(seed: int = 0):
    return build_model(preset("tiny", num_layers=2), seed=seed)


def test_padded_bucket_geometry():
    b = choose_bucket([5, 2, 8], [4, 2, 5], max_tokens=64, max_positions=4096, padded=True)
    assert b.tokens == 64 and b.width == 64 and b.max_len == 64
    assert b.seqs == 8 and b.batch == 8 and b.cols == 64 and b.rows == 16
    # A single sequence over the budget gets whole multiples of it.
    b = choose_bucket([100], [50], max_tokens=64, max_positions=4096, padded=True)
    assert b.tokens == 128 and b.width == 128 and b.rows >= 50
    # Exact fit: nothing padded.
    b = choose_bucket([5, 2, 8], [4, 2, 5], max_tokens=64, max_positions=4096, padded=False)
    assert (b.tokens, b.seqs, b.max_len, b.width, b.rows, b.batch, b.cols) == (15, 3, 8, 16, 11, 3, 5)
    # Lengths near the position limit are not rounded past it.
    b = choose_bucket([70], [3], max_tokens=128, max_positions=80, padded=True)
    assert b.width == 80


def test_padded_layout_keeps_padding_out_of_the_loss():
    tm = TrainMicrobatch.build(SEQS, PLENS, max_tokens=64, max_positions=4096, padded=True)
    x, bk = tm.inputs, tm.bucket
    n_real = sum(len(s) - 1 for s in SEQS)
    assert x["input_ids"].shape == (bk.tokens,) and x["key_slots"].shape == (bk.seqs, bk.width)
    assert int(x["cu_seqlens"][-1]) == bk.tokens  # every row belongs to a sequence
    comp = [len(s) - p for s, p in zip(SEQS, PLENS)]
    assert tm.completion_lens == comp
    # The loss reads real completion rows only; padding entries point at the appended zero.
    idx = x["loss_index"]
    assert idx.shape == (bk.batch, bk.cols)
    for j, c in enumerate(comp):
        rows = x["row_index"][idx[j, :c]]
        assert bool((rows < n_real).all())
        assert bool((idx[j, c:] == bk.rows).all())
    assert bool((idx[len(SEQS) :] == bk.rows).all())
    # Each completion token's target is the token itself.
    got = x["row_targets"][idx[0, : comp[0]]].tolist()
    assert got == SEQS[0][PLENS[0] :]


def test_completion_logprobs_are_the_same_bits_in_any_bucket():
    model = _model()
    with torch.no_grad():
        pb = PackedBatch.build(SEQS, PLENS)
        ref, _, sidx = response_logprobs(model, pb, 0.7, True)
        for padded in (False, True):
            tm = TrainMicrobatch.build(SEQS, PLENS, max_tokens=64, max_positions=4096, padded=padded)
            lp, ent = microbatch_logprobs(model, tm.inputs, tm.bucket, 0.7)
            for j, c in enumerate(tm.completion_lens):
                assert torch.equal(lp[j, :c], ref[sidx == j]), (padded, j)
                assert bool((lp[j, c:] == 0).all()) and bool((ent[j, c:] == 0).all())
        # Negative control: the same comparison sees a one-token change of a sequence's prompt.
        other = [list(SEQS[0]), *SEQS[1:]]
        other[0][0] = 30
        tm = TrainMicrobatch.build(other, PLENS, max_tokens=64, max_positions=4096, padded=True)
        lp, _ = microbatch_logprobs(model, tm.inputs, tm.bucket, 0.7)
        assert not torch.equal(lp[0, : tm.completion_lens[0]], ref[sidx == 0])
        assert torch.equal(lp[1, : tm.completion_lens[1]], ref[sidx == 1])


def _rollouts(model, seed: int) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
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


@pytest.mark.parametrize("algorithm", ["grpo", "gspo"])
def test_padded_trainer_step_matches_the_unpadded_one(algorithm):
    results = []
    for padded in (False, True):
        model = _model(seed=1)
        rollouts = _rollouts(model, seed=2)
        settings = TrainerSettings(
            AlgorithmConfig(
                name=algorithm,
                minibatches_per_rollout=2,
                entropy_coef=0.01,
                eps_low=3e-4 if algorithm == "gspo" else 0.2,
                eps_high=4e-4 if algorithm == "gspo" else 0.2,
            ),
            max_tokens_per_microbatch=32,
            pad_microbatches=padded,
        )
        trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-3))
        m = trainer.step(rollouts)
        results.append((m, [p.detach().clone() for p in model.parameters()]))
    (m0, w0), (m1, w1) = results
    # Exact mode: the trainer's logprobs equal the recorded ones in both layouts.
    assert m0["mismatch/num_mismatched_tokens"] == m1["mismatch/num_mismatched_tokens"] == 0.0
    assert m0["mismatch/num_tokens"] == m1["mismatch/num_tokens"] > 0
    assert m0["optimizer_steps"] == m1["optimizer_steps"] == 2
    assert m0["num_tokens"] == m1["num_tokens"] and m0["clip_frac"] == m1["clip_frac"]
    # Sums over a [batch, cols] matrix with more zero padding may round in another order: close, not equal.
    for k in ("entropy", "ratio/mean", "loss"):
        assert math.isclose(m0[k], m1[k], rel_tol=1e-6, abs_tol=1e-9), k
    # The update: padding adds zero rows to each weight-gradient sum, and the CPU's matmul blocks a longer sum
    # differently, so the weights agree to rounding (here ~1e-7 after two AdamW steps at lr 1e-3), not bitwise.
    # (On the GPU a graph replay and an eager run of the same bucket are bitwise equal: tests/train/test_graphs_gpu.)
    for a, b in zip(w0, w1):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    assert not all(torch.equal(a, b) for a, b in zip(w0, _model(seed=1).parameters()))  # it did train
