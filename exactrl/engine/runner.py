"""The model runner: everything that touches tensors in the rollout engine.

It owns the paged KV cache (one (k, v) pair per layer, [num_blocks, block_size, Hkv, Dh]) and turns a scheduled
step (for each sequence: its new tokens, how many of its tokens are already cached, its block table) into one
flat forward of the *shared* model, the same module the trainer updates. Bookkeeping (which blocks, which
tokens) stays in plain Python in block_manager.py and scheduler.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.model.qwen import CausalLM
from exactrl.ops import BLOCK_N, AttentionBatch


@dataclass
class StepEntry:
    """One sequence's part of a step: `token_ids` are new rows at positions num_cached .. num_cached+len-1."""

    token_ids: list[int]
    num_cached: int
    block_table: list[int]


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype | None = None) -> int:
    cfg = model.config
    itemsize = torch.empty((), dtype=dtype or model.dtype).element_size()
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize


def auto_num_blocks(model: CausalLM, block_size: int, memory_fraction: float, max_tokens_needed: int) -> int:
    """KV blocks from free device memory (CUDA) or a capped budget (CPU), never more than the work needs."""
    per_block = kv_bytes_per_token(model) * block_size
    need = -(-max_tokens_needed // block_size) + 1
    if model.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(model.device)
        budget = int(free * memory_fraction)
    else:
        budget = int(2 * 1024**3 * memory_fraction)
    return max(2, min(need, budget // per_block))


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int):
        if block_size % BLOCK_N:
            raise ValueError(
                f"engine.block_size {block_size} must be a multiple of the attention tile {BLOCK_N}"
            )
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zero-filled: masked keys are multiplied by exactly 0, which needs finite values behind them.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=model.dtype, device=model.device),
                torch.zeros(shape, dtype=model.dtype, device=model.device),
            )
            for _ in range(cfg.num_layers)
        ]

    @torch.no_grad()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole KV blocks src -> dst in every layer."""
        if not pairs:
            return
        dev = self.model.device
        src = torch.tensor([p[0] for p in pairs], device=dev)
        dst = torch.tensor([p[1] for p in pairs], device=dev)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @torch.no_grad()
    def forward(self, entries: list[StepEntry]) -> torch.Tensor:
        """Run one step; return the final hidden state of the last new row of every entry: [len(entries), D]."""
        dev = self.model.device
        ids = torch.tensor([t for e in entries for t in e.token_ids], dtype=torch.int64, device=dev)
        batch = AttentionBatch.paged(
            [e.num_cached for e in entries],
            [len(e.token_ids) for e in entries],
            [e.block_table for e in entries],
            self.block_size,
            device=dev,
        )
        hidden = self.model(ids, batch.q_pos, batch, self.kv_caches)
        return hidden[batch.cu_seqlens_q[1:] - 1]
