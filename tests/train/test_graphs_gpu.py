"""The training step replayed from CUDA graphs gives the eager step's bits (marker `gpu`).

Both trainers pad microbatches to the same buckets; one replays captured graphs, the other runs the same body
eagerly. Over several steps (two minibatches each, so gradients accumulate across microbatches and more than one
bucket is captured) the weights and every metric are equal with `torch.equal` / `==`."""

from __future__ import annotations

import pytest
import torch

from exactrl.config import AlgorithmConfig
from exactrl.model import build_model, preset
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import completion_logprobs
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rollouts(model, seed: int, flip: bool = False) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(12):
        p = torch.randint(1, 250, (5 + 3 * i,), generator=g).tolist()
        c = torch.randint(1, 250, (4 + (11 * i) % 37,), generator=g).tolist()
        adv = float(i % 3) - 1.0
        out.append(Rollout(p, c, torch.zeros(len(c)), advantage=-adv if flip else adv))
    seqs = [r.prompt_ids + r.completion_ids for r in out]
    for r, lp in zip(out, completion_logprobs(model, seqs, [len(r.prompt_ids) for r in out])):
        r.rollout_logprobs = lp
    return out


def _run(exact: bool, graphs: bool, flip: bool = False, steps: int = 3, max_graphs: int = 64):
    from exactrl.ops import set_exact_environment

    set_exact_environment(exact)
    model = build_model(preset("tiny"), device="cuda", dtype=torch.bfloat16, exact=exact, seed=0)
    settings = TrainerSettings(
        AlgorithmConfig(minibatches_per_rollout=2, entropy_coef=0.01),
        max_tokens_per_microbatch=256,
        exact=exact,
        cuda_graphs=graphs,
        pad_microbatches=True,
    )
    trainer = PolicyTrainer(model, settings, MasterAdamW(model, lr=1e-4))
    trainer.graphs.max_graphs = max_graphs
    history = []
    for step in range(steps):
        metrics = trainer.step(_rollouts(model, seed=10 + step, flip=flip))
        history.append((metrics, [p.detach().clone() for p in model.parameters()]))
    return trainer, history


@pytest.mark.parametrize("exact", [True, False])
def test_graph_training_step_equals_eager(exact):
    eager, a = _run(exact, graphs=False)
    graph, b = _run(exact, graphs=True)
    assert (
        eager.graphs.captures == 0
        and graph.graphs.captures >= 2
        and graph.graphs.replays > graph.graphs.captures
    )
    for (ma, wa), (mb, wb) in zip(a, b):
        assert mb["perf/train_graphs"] >= 2 and "perf/train_graphs" not in ma
        ma = {k: v for k, v in ma.items() if not k.startswith("perf/")}
        mb = {k: v for k, v in mb.items() if not k.startswith("perf/")}
        assert ma.keys() == mb.keys()
        for k in ma:
            assert ma[k] == mb[k] or (ma[k] != ma[k] and mb[k] != mb[k]), k
        for x, y in zip(wa, wb):
            assert torch.equal(x, y)
        if exact:
            assert ma["mismatch/num_mismatched_tokens"] == 0.0
    # Negative control: the same comparison sees a flipped advantage.
    _, c = _run(exact, graphs=True, flip=True, steps=1)
    assert not all(torch.equal(x, y) for x, y in zip(a[0][1], c[0][1]))


def test_graphs_follow_reallocated_weights():
    _, ref = _run(True, graphs=False, steps=2)
    trainer, _ = _run(True, graphs=True, steps=1)
    captures = trainer.graphs.captures
    # Replace the weights' storage (as a checkpoint load that assigns new tensors would): the graphs must not
    # keep reading the old memory.
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.data = p.data.clone()
    metrics = trainer.step(_rollouts(trainer.model, seed=11))
    assert trainer.graphs.captures > captures
    for x, y in zip(ref[1][1], trainer.model.parameters()):
        assert torch.equal(x, y)
    assert metrics["optimizer_steps"] == 2


def test_device_side_skip_and_clip():
    """clip_and_step_async on CUDA: a skip flag or a non-finite gradient leaves weights, moments and the step
    count alone without a host read; a large gradient is clipped to max_norm, a small one is not touched."""
    model = build_model(preset("tiny", num_layers=1), device="cuda", dtype=torch.bfloat16, seed=0)
    opt = MasterAdamW(model, lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]

    def set_grads(value: float) -> None:
        for p in opt.params:
            p.grad = torch.full_like(p, value)

    set_grads(1.0)
    norm = opt.clip_and_step_async(1.0, skip=torch.tensor(True, device="cuda"))
    assert norm is not None and torch.isnan(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    set_grads(float("inf"))
    assert torch.isnan(opt.clip_and_step_async(1.0))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(float(st["step"]) == 0 for st in opt.opt.state.values())
    # A real step: the norm comes back, the weights move, the step count is 1.
    set_grads(1.0)
    n = sum(p.numel() for p in opt.params)
    norm = opt.clip_and_step_async(1.0)
    assert abs(float(norm) - n**0.5) < 1e-6 * n**0.5
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(float(st["step"]) == 1 for st in opt.opt.state.values())
    # Clipped: AdamW normalises the gradient scale away on the first step, so check the moments instead:
    # exp_avg = (1 - beta1) * clipped gradient.
    opt2 = MasterAdamW(
        build_model(preset("tiny", num_layers=1), device="cuda", dtype=torch.bfloat16), lr=1e-3
    )
    for p in opt2.params:
        p.grad = torch.full_like(p, 2.0)
    n2 = sum(p.numel() for p in opt2.params)
    opt2.clip_and_step_async(1.0)
    g = 2.0 / ((2.0 * n2**0.5 + 1e-6) / 1.0)
    for st in opt2.opt.state.values():
        assert torch.allclose(st["exp_avg"], torch.full_like(st["exp_avg"], 0.1 * g), rtol=1e-5)


def test_buckets_past_the_graph_cap_run_eagerly_with_the_same_bits():
    _, ref = _run(True, graphs=False, steps=2)
    trainer, got = _run(True, graphs=True, steps=2, max_graphs=1)
    assert len(trainer.graphs) == 1 and trainer.graphs.eager_runs > 0 and trainer.graphs.replays > 0
    for (_, wa), (_, wb) in zip(ref, got):
        for x, y in zip(wa, wb):
            assert torch.equal(x, y)
