"""Tiny LoRA models for the tests: adapters that look trained (B != 0), on the CPU."""

from __future__ import annotations

import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.model.lora import LoraSpec, add_lora, lora_modules
from exactrl.train.packing import completion_logprobs

PROMPTS = [
    [5, 17, 3, 99, 42],
    [7] * 19,
    [11, 12, 13, 200, 201, 202, 7, 8, 9, 30, 31, 32, 33, 34, 35, 36, 1, 2, 3],
]


def tiny(dtype=torch.float32, exact=True, seed=0, **cfg):
    return build_model(preset("tiny", num_layers=2, **cfg), dtype=dtype, exact=exact, seed=seed)


@torch.no_grad()
def trained_looking(model, seed: int = 7, std: float = 0.05):
    """Give every B random values (PEFT's init leaves B = 0, which would make the adapter a no-op)."""
    g = torch.Generator().manual_seed(seed)
    for m in lora_modules(model):
        for i, _ in m.targets:
            b = m.B(i)
            b.copy_(torch.randn(b.shape, generator=g) * std)
    return model


def lora_model(dtype=torch.float32, exact=True, rank=8, alpha=16.0, targets=None, seed=0, **cfg):
    model = tiny(dtype, exact, seed, **cfg)
    spec = LoraSpec(rank=rank, alpha=alpha, **({"target_modules": tuple(targets)} if targets else {}))
    add_lora(model, spec, seed=seed + 1)
    return trained_looking(model)


def rollouts_and_scores(model, engine=None, temperature=0.7, n=2, max_tokens=16, seed=1, decode_mode=None):
    """(engine outputs flattened to (prompt, completion, rollout_logprobs), trainer logprobs of the same)."""
    eng = engine or RolloutEngine(
        model,
        EngineConfig(
            num_kv_blocks=64,
            prefill_chunk_size=16,
            max_num_batched_tokens=256,
            max_num_seqs=8,
            max_model_len=64,
        ),
    )
    if decode_mode is not None:
        eng.decode_mode = decode_mode
    outs = eng.generate(
        PROMPTS, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=n)
    )
    flat = [(p, s.token_ids, s.rollout_logprobs) for p, o in zip(PROMPTS, outs) for s in o.samples]
    scores = score(model, flat, temperature)
    return flat, scores


def score(model, flat, temperature=0.7) -> list[torch.Tensor]:
    """The trainer's logprobs of the engine's completions (packed whole sequences, no KV cache)."""
    seqs, plens = [p + c for p, c, _ in flat], [len(p) for p, _, _ in flat]
    return completion_logprobs(model, seqs, plens, temperature=temperature)


def count_mismatched(flat, scores) -> tuple[int, int, float]:
    """(mismatched tokens, tokens, max |diff|) between engine and trainer logprobs."""
    bad = tot = 0
    worst = 0.0
    for (_, _, rec), lp in zip(flat, scores):
        bad += int((rec != lp).sum())
        tot += rec.numel()
        worst = max(worst, float((rec - lp).abs().max()))
    return bad, tot, worst


# Sequences for comparisons with transformers (T = 1, every next token scored).
SEQS_HF = [[(31 * i + 7 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((7, 33, 18))]
