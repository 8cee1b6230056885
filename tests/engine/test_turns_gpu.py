"""Multi-turn episodes on the GPU (marker `gpu`): the CPU test of tests/engine/test_turns.py on cuda, in bf16,
with the Triton exact ops and the engine's CUDA-graph decode. Every model token of every turn has the trainer's
logprob bit for bit, under preemption (paused episodes' blocks taken too) and prefix sharing, with observations
of varied length (a hashing environment, 1 to 23 tokens) and with the built-in guessing game's text answers.
Fast mode (cuBLAS, FlashAttention) is the negative control: the same comparison finds differences there, so it can fail."""

from __future__ import annotations

import pytest
import torch
from test_turns import VariedObservations  # the sibling module: the same environment as the CPU test

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs import EpisodeSettings, run_episodes
from exactrl.envs.guess import GuessNumberEnv
from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.ops import set_exact_environment
from exactrl.tasks.base import Example
from exactrl.train.packing import masked_completion_logprobs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ENVS = {"varied": VariedObservations, "guess": GuessNumberEnv}
TEMPERATURE = 0.8
_MODELS: dict[tuple[str, bool], torch.nn.Module] = {}


def _model(name: str, exact: bool):
    if (name, exact) not in _MODELS:
        _MODELS[(name, exact)] = build_model(
            preset(name), device="cuda", dtype=torch.bfloat16, exact=exact, seed=0
        )
    return _MODELS[(name, exact)]


def _episodes(name: str, env: str, exact: bool = True):
    set_exact_environment(exact)
    m = _model(name, exact)
    eng = RolloutEngine(
        m,
        EngineConfig(
            num_kv_blocks=14,  # room for about two episodes of 160 tokens: preemption, paused evictions
            prefill_chunk_size=16,
            max_num_batched_tokens=64,
            enable_prefix_caching=True,
            cuda_graphs=True,
            max_model_len=256,
        ),
        tokenizer=byte_tokenizer(),
    )
    # Varied lengths; prompts 3 and 4 share their first 16 tokens (one full KV block: a prefix-cache hit).
    prompts = [[10 + i, 20, 30 + 2 * i, 40] * (3 + i) for i in range(3)]
    prompts.append(prompts[2][:16] + [77, 78, 79])
    examples = [Example("p", "42") for _ in prompts]  # the guessing game's secret
    settings = EpisodeSettings(max_turns=4, max_tokens_per_turn=10, max_episode_tokens=160)
    params = SamplingParams(temperature=TEMPERATURE, n=2, seed=5, stop=["\n"])
    batch = run_episodes(eng, eng.tokenizer, examples, prompts, ENVS[env], settings, params)
    eps = [e for g in batch.groups for e in g]
    lps = masked_completion_logprobs(
        m,
        [e.token_ids for e in eps],
        [len(e.prompt_ids) for e in eps],
        [e.loss_mask for e in eps],
        TEMPERATURE,
    )
    return batch, eps, lps


@pytest.mark.parametrize("env", list(ENVS))
@pytest.mark.parametrize("name", ["tiny", "qwen3-0.6b"])
def test_every_turn_is_exact_on_the_gpu(name: str, env: str) -> None:
    try:
        batch, eps, lps = _episodes(name, env)
    finally:
        set_exact_environment(True)
    assert len(eps) == 8 and all(e.error is None for e in eps), [e.error for e in eps]
    assert batch.cache["preemptions"] > 0, "the small cache was meant to force preemption"
    if name == "tiny":  # the cache size is tuned on the tiny shape; at 0.6b the guess episodes fit (H100 run)
        assert batch.cache["paused_evictions"] > 0, "and to take the blocks of episodes waiting for their env"
    assert batch.cache["fork_shared_blocks"] > 0, "the samples of a group were meant to share the prompt"
    assert max(e.num_turns for e in eps) > 1
    # Length variety is asserted for the environment built for it (a random model with a large vocabulary rarely
    # writes a digit, so the guessing game's answer repeats).
    if env == "varied":
        assert len({o[1] - o[0] for e in eps for o in e.observations}) > 1
    for e in eps:  # the mask is False exactly at the observations, and logprobs are 0 there
        obs = {p for s, t in e.observations for p in range(s, t)}
        assert e.loss_mask == [p not in obs for p in range(len(e.completion_ids))]
        assert not e.rollout_logprobs[[not x for x in e.loss_mask]].any()
    n_tok = sum(sum(e.loss_mask) for e in eps)
    mismatched = sum(int((a != e.rollout_logprobs).sum()) for a, e in zip(lps, eps))
    print(
        f"\n{name} {env}: {len(eps)} episodes, {sum(e.num_turns for e in eps)} turns, {n_tok} model tokens, "
        f"{mismatched} mismatched, cache {batch.cache}"
    )
    assert n_tok > 100 and mismatched == 0
    assert all(torch.equal(a, e.rollout_logprobs) for a, e in zip(lps, eps))


def test_fast_mode_negative_control_on_the_gpu() -> None:
    """PyTorch's default kernels (cuBLAS, SDPA): the decode path and the trainer's packed forward round
    differently, and the same comparison finds it."""
    try:
        _, eps, lps = _episodes("qwen3-0.6b", "varied", exact=False)
    finally:
        set_exact_environment(True)
    assert any(not torch.equal(a, e.rollout_logprobs) for a, e in zip(lps, eps))
