"""The `[engine]` and `[sampling]` sections: the rollout engine's sizing and how rollouts are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field

from exactrl.config.errors import _check_at_least, _check_nonneg, _fail


@dataclass
class EngineConfig:
    """Rollout engine: paged KV cache, scheduler limits and CUDA graphs."""

    block_size: int = 16
    """Tokens per KV-cache block; must be a multiple of 16."""
    num_kv_blocks: int | None = None
    """Number of KV-cache blocks; unset = sized from kv_memory_fraction of free device memory."""
    kv_memory_fraction: float = 0.45
    """Fraction of free device memory given to the KV cache when num_kv_blocks is unset, in (0, 1]. In
    `exactrl train` on a GPU, free means what the memory plan leaves in the phases that hold the cache (with
    release_memory the generation phase alone, else all three), everything resident counted (optimizer state, the
    training graphs), so the cache never crowds out training; elsewhere, what the device has free when the cache
    is first allocated."""
    max_num_seqs: int = 256
    """Maximum number of sequences the scheduler runs concurrently."""
    max_num_batched_tokens: int = 4096
    """Maximum number of tokens (prefill + decode) in one engine forward pass."""
    prefill_chunk_size: int = 2048
    """Long prompts are prefilled in chunks of at most this many tokens."""
    cuda_graphs: bool = True
    """Capture decode steps in CUDA graphs (ignored on CPU)."""
    max_model_len: int = 2048
    """Maximum total sequence length (prompt + completion) the engine accepts."""
    enable_prefix_caching: bool = True
    """Reuse the KV-cache blocks of a prompt prefix the cache already holds (the samples of one prompt, a
    multi-turn episode's earlier turns) instead of computing them again; false computes every prompt in full."""
    release_memory: bool = True
    """Memory phases of `exactrl train`: free the KV cache (and under torchrun the engine's weight replica) while
    the trainer runs, and allocate them again before the next generation (the replica is rebuilt by the weight
    sync's all-gather), so that generation and training do not hold each other's memory. The same bits either
    way. Not with algorithm.max_off_policy_steps >= 1 or algorithm.overlap = "tail", where generation runs during
    training."""
    tensor_parallel: int = 1
    """Ranks that share one rollout engine, each holding 1/T of its weights and KV cache, sampling the bits of the
    one-device engine (exactrl/distributed/tensor_parallel.py). Under torchrun (`exactrl train --nproc N`, T
    dividing N) each group of T ranks samples the union of its ranks' prompts in one engine call and every rank
    trains on its own share, as at T = 1 (exactrl/distributed/shared_engine.py); `exactrl parity --tensor-parallel
    T` checks it. LoRA adapters split with their projections (A whole on every rank, B's rows with the weight's).
    With distributed.generator_ranks = G (T dividing G) the generators form G / T engines of T ranks each and the
    trainers hold whole replicas (one step off and partial rollouts run there too). Multi-turn episodes run in
    lockstep on the group's ranks, each calling its own prompts' environment (exactrl/envs/rollout.py). Not with one
    step off on colocated ranks (refused)."""
    expert_parallel: int = 1
    """Ranks that share one rollout engine of a mixture-of-experts model, each holding 1/E of every sparse layer's
    routed experts (exactrl/distributed/expert_parallel.py); E must divide the experts. Runs like
    engine.tensor_parallel (the same group when both are above 1, so then they must be equal); `exactrl parity
    --expert-parallel E` checks it. Refused for dense models. LoRA (attention adapters) stays whole on every rank."""

    def validate(self) -> None:
        _check_at_least(self.tensor_parallel, 1, "engine.tensor_parallel")
        _check_at_least(self.expert_parallel, 1, "engine.expert_parallel")
        if 1 < self.tensor_parallel != self.expert_parallel > 1:
            _fail(
                "engine.expert_parallel",
                f"({self.expert_parallel}) must equal engine.tensor_parallel ({self.tensor_parallel}) when both "
                "are above 1: they split one engine over the same ranks",
            )
        _check_at_least(self.block_size, 16, "engine.block_size")
        if self.block_size % 16:
            _fail("engine.block_size", f"must be a multiple of 16, got {self.block_size}")
        if self.num_kv_blocks is not None:
            _check_at_least(self.num_kv_blocks, 1, "engine.num_kv_blocks")
        if not (0 < self.kv_memory_fraction <= 1):
            _fail("engine.kv_memory_fraction", f"must be in (0, 1], got {self.kv_memory_fraction!r}")
        _check_at_least(self.max_num_seqs, 1, "engine.max_num_seqs")
        _check_at_least(self.max_num_batched_tokens, 1, "engine.max_num_batched_tokens")
        _check_at_least(self.prefill_chunk_size, 1, "engine.prefill_chunk_size")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            _fail(
                "engine.prefill_chunk_size",
                f"({self.prefill_chunk_size}) must be <= engine.max_num_batched_tokens "
                f"({self.max_num_batched_tokens})",
            )
        _check_at_least(self.max_model_len, 1, "engine.max_model_len")


@dataclass
class SamplingConfig:
    """How rollouts are sampled from the policy."""

    temperature: float = 1.0
    """Sampling temperature; 0 = greedy. Logprobs are computed at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest token set with this much probability mass, in (0, 1]; 1 = off."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 = off."""
    max_tokens: int = 128
    """Maximum number of generated tokens per completion (per model turn when env.name is set)."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a completion when generated (the stop string is kept in the text)."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a completion, besides the tokenizer's end-of-sequence token."""

    def validate(self) -> None:
        _check_nonneg(self.temperature, "sampling.temperature")
        if not (0 < self.top_p <= 1):
            _fail("sampling.top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check_at_least(self.top_k, 0, "sampling.top_k")
        _check_at_least(self.max_tokens, 1, "sampling.max_tokens")
        for i, s in enumerate(self.stop):
            if not s:
                _fail(f"sampling.stop[{i}]", "must not be an empty string")
        for i, t in enumerate(self.stop_token_ids):
            _check_at_least(t, 0, f"sampling.stop_token_ids[{i}]")
