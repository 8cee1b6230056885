"""exactrl/bench_torch.py: the stock-PyTorch baseline of `exactrl bench train --vs torch` computes the function
exactrl's model computes (same weights, same tokens: the same logprobs within fp32 rounding; a wrong RoPE or a
missing q/k norm is far off), its step trains, and the benchmark reports it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from exactrl.bench_torch import (
    GrpoBatch,
    TorchDecoder,
    TorchGrpoStep,
    check_compile_available,
    compiled_graph_count,
)
from exactrl.model.config import ModelConfig, preset
from exactrl.model.qwen import CausalLM, build_model
from exactrl.ops import AttentionBatch

# fp32 on the CPU: the two decoders differ only in the order of some reductions (SDPA vs exactrl's tiled attention,
# inductor's fusions), a few 1e-6 on logprobs of magnitude ~5 (measured: at most 1.6e-5).
ATOL = 1e-4
B, L = 3, 48

CONFIGS = {
    "qwen3 (tied head, q/k norm)": preset("tiny"),
    "llama (untied head, llama3 rope)": preset("tiny-llama"),
    "qwen2 (q/k/v biases)": replace(preset("tiny"), architecture="qwen2"),
    "llama (attention and mlp biases)": replace(preset("tiny-llama"), attention_bias=True, mlp_bias=True),
}


def _model(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> CausalLM:
    """A model whose outputs depend visibly on every weight, as a trained one's do: matrices at std 0.2 (the default
    0.02 gives near-uniform logprobs that hide a wrong RoPE), norm weights and biases away from 1 and 0."""
    model = build_model(cfg, dtype=torch.float32, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.init_weights(seed=0, std=0.2)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


def _batch(cfg: ModelConfig, device: str = "cpu") -> GrpoBatch:
    g = torch.Generator().manual_seed(2)
    seqs = torch.randint(0, cfg.vocab_size, (B, L + 1), generator=g).tolist()
    old = -5.0 + torch.rand(B, L, generator=g)  # near the logprobs, so some ratios land inside the clip range
    return GrpoBatch.from_sequences(seqs, old, [1.0, -0.5, 0.25], prompt_len=1, device=device)


def _exactrl_logprobs(model: CausalLM, batch: GrpoBatch) -> torch.Tensor:
    """The trainer's logprobs of batch's targets: the sequences packed into one flat stream. -> [B, L] fp32"""
    ids = batch.input_ids.reshape(-1)
    pos = torch.arange(L).repeat(B)
    with torch.no_grad():
        hidden = model(ids, pos, AttentionBatch.packed([L] * B))
        lp, _ = model.logprobs(hidden, batch.targets.reshape(-1))
    return lp.view(B, L)


def _baseline_logprobs(base: TorchDecoder, batch: GrpoBatch) -> torch.Tensor:
    _, lp, _ = base.loss(batch)
    return lp


@pytest.mark.parametrize("name", list(CONFIGS))
def test_eager_baseline_computes_the_models_logprobs(name):
    cfg = CONFIGS[name]
    model, batch = _model(cfg), _batch(cfg)
    ref = _exactrl_logprobs(model, batch)
    got = _baseline_logprobs(TorchDecoder.from_model(model), batch)
    assert (
        ref.std() > 0.5
    )  # peaked distributions, as a trained model's are (a weak check would pass anything)
    assert (got - ref).abs().max().item() < ATOL


def test_the_loss_is_grpos_clipped_token_mean():
    from exactrl.algorithms import policy_loss_terms

    cfg = CONFIGS["qwen3 (tied head, q/k norm)"]
    model, batch = _model(cfg), _batch(cfg)
    base = TorchDecoder.from_model(model)
    # The sampling policy a little off the current one, as after an update: ratios on both sides of the clip.
    _, lp, _ = base.loss(batch)
    batch.old_logprobs = lp + 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(3))
    loss, lp, _ = base.loss(batch)
    ratio = (lp - batch.old_logprobs).exp()
    clipped = ((ratio < 0.8) | (ratio > 1.2)).float().mean()
    assert 0.05 < clipped < 0.95  # both branches of the clip are exercised
    ref, _ = policy_loss_terms(lp, batch.old_logprobs, batch.advantages, batch.loss_mask, kind="ppo_clip")
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(lambda c: replace(c, rope_theta=c.rope_theta * 2), id="wrong rope theta"),
        # llama is qwen3 without the per-head q/k norm (and with the same defaults otherwise)
        pytest.param(lambda c: replace(c, architecture="llama"), id="q/k norm left out"),
    ],
)
def test_a_baseline_of_another_function_is_far_off(plant):
    cfg = CONFIGS["qwen3 (tied head, q/k norm)"]
    model, batch = _model(cfg), _batch(cfg)
    ref = _exactrl_logprobs(model, batch)
    got = _baseline_logprobs(TorchDecoder.from_model(model, config=plant(cfg)), batch)
    assert (got - ref).abs().max().item() > 100 * ATOL


def test_compiled_baseline_computes_the_models_logprobs_with_one_graph_per_block_kind():
    cfg = CONFIGS["llama (untied head, llama3 rope)"]
    model, batch = _model(cfg), _batch(cfg)
    ref = _exactrl_logprobs(model, batch)
    base = TorchDecoder.from_model(model).compile_blocks()
    torch._dynamo.reset()  # count this model's graphs alone, whatever earlier tests compiled
    before = compiled_graph_count()
    got = _baseline_logprobs(base, batch)
    assert (got - ref).abs().max().item() < ATOL
    # The 4 identical blocks share one traced graph (a per-layer trace would give 4 + 1), plus the head + loss.
    assert cfg.num_layers == 4 and compiled_graph_count() - before == 2


@pytest.mark.extended  # a bf16 compile of the baseline's whole step (about 20 s on 2 cores)
def test_one_step_moves_the_bf16_weights_and_the_masters():
    cfg = CONFIGS["qwen3 (tied head, q/k norm)"]
    model = _model(cfg, torch.bfloat16)
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    base = TorchDecoder.from_model(model).compile_blocks()
    step = TorchGrpoStep(base, lr=1e-3)
    assert step.has_master and all(m.dtype == torch.float32 for m in step.master)
    weights = [p.detach().clone() for p in step.params]
    masters = [m.detach().clone() for m in step.master]
    out = step(_batch(cfg))
    assert torch.isfinite(out["loss"]) and torch.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    assert all(p.grad is None for p in step.params)  # the gradients were moved onto the masters and dropped
    assert all(not torch.equal(a, b) for a, b in zip(masters, step.master))
    # Every matrix moves by more than a bf16 rounding at lr 1e-3; the ones-like norm weights may not.
    matrices = [(a, b) for a, b in zip(weights, step.params) if b.dim() == 2]
    assert matrices and all(not torch.equal(a, b) for a, b in matrices)
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(step.params, step.master))
    # A copy, not shared: exactrl's model did not move.
    assert all(torch.equal(p, kept[n]) for n, p in model.named_parameters())


def test_dense_models_only():
    with pytest.raises(ValueError, match="covers dense models"):
        TorchDecoder(preset("tiny-moe"))


def test_compile_needs_a_cxx_compiler(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        check_compile_available("cpu")


TRAIN = ["bench", "train", "--preset", "tiny", "--device", "cpu", "--dtype", "float32"]


@pytest.mark.slow
@pytest.mark.extended  # the script's dry run (tests/test_benchmark_scripts.py) runs the same path by default
def test_bench_train_vs_torch_reports_the_baseline(tmp_path, capsys):
    from exactrl.cli import main

    argv = [*TRAIN, "--tokens-per-microbatch", "256", "--steps", "1", "--vs", "torch", "--json"]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rec = json.loads(next(line for line in reversed(out.splitlines()) if line.startswith("{")))
    for key in ("torch_tokens_per_s", "torch_mfu", "torch_compile_s", "over_torch"):
        assert rec[key] > 0, key
    assert rec["over_torch"] == rec["tokens_per_s"] / rec["torch_tokens_per_s"]
    assert rec["torch_tokens_per_s"] == rec["tokens_per_step"] / rec["torch_step_s"]
    # exactrl's own step: the median step beside the mean
    assert rec["tokens_per_s_median"] == rec["tokens_per_step"] / rec["step_s_median"]
    assert rec["tokens_per_s"] == rec["tokens_per_step"] / rec["step_s"]
    assert "torch (compiled, stock)" in out  # the table shows both steps


def test_bench_train_vs_torch_refuses_a_mixture_of_experts(tmp_path, capsys):
    from exactrl.cli import main

    argv = [*TRAIN, "--tokens-per-microbatch", "64", "--steps", "1", "--vs", "torch"]
    argv[3] = "tiny-moe"
    assert main([*argv, "--out-dir", str(tmp_path)]) != 0
    assert (
        "bench train --vs torch covers dense models; tiny-moe is a mixture of experts"
        in capsys.readouterr().err
    )
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_back_to_back_step_times_times_each_step_after_a_warm_up() -> None:
    import time

    from exactrl.bench import back_to_back_step_times

    calls = []

    def step() -> None:  # the warm-up call sleeps longest: it must not be among the times
        time.sleep(1.0 if not calls else 0.01 * len(calls))
        calls.append(1)

    times = back_to_back_step_times(step, 3, "cpu")
    assert len(calls) == 4 and len(times) == 3
    assert all(t >= 0.01 * (i + 1) for i, t in enumerate(times)), times  # each step's own time, in order
    assert max(times) < 0.9, times  # not the warm-up's (a loaded machine's sleep may overshoot a little)
