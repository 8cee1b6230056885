"""Small models of every preset's architecture for the CPU tests: `small_shape` keeps a preset's options at a test
size, `trained_looking` gives it weights whose logprobs spread over several nats."""

from __future__ import annotations

import dataclasses

import torch

from exactrl.model.config import ModelConfig
from exactrl.model.qwen import build_model


def small_shape(cfg: ModelConfig) -> ModelConfig:
    """The preset's architecture at a CPU-test size: 2 layers, hidden 72, intermediate 104, vocab 300, the preset's
    query/key-value head ratio kept (capped), experts 6 (top-k kept below that)."""
    group = max(1, min(cfg.num_heads // cfg.num_kv_heads, 4))
    kv = 2 if group < 4 else 1
    over: dict = dict(
        vocab_size=300,
        hidden_size=72,
        intermediate_size=104,
        num_layers=2,
        num_heads=kv * group,
        num_kv_heads=kv,
        head_dim=24,
        max_position_embeddings=min(cfg.max_position_embeddings, 2048),
    )
    if cfg.is_moe:
        over.update(
            num_experts=6,
            num_experts_per_tok=min(cfg.num_experts_per_tok, 3),
            moe_intermediate_size=40,
            mlp_only_layers=tuple(i for i in cfg.mlp_only_layers if i < 2),
            decoder_sparse_step=min(cfg.decoder_sparse_step, 2),
        )
        if cfg.has_shared_expert:
            over["shared_expert_intermediate_size"] = 56
    return dataclasses.replace(cfg, **over)


def trained_looking(cfg: ModelConfig, dtype: torch.dtype, seed: int = 0):
    """A model whose logprobs spread over several nats and whose norms, biases and gates are not 0/1 (an
    untrained init would put every shared-expert gate near 0.5 and hide a detail we forgot)."""
    model = build_model(cfg, device="cpu", dtype=torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model.to(dtype)
