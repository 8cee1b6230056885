"""Multi-turn episodes on the engine (tiny model, CPU): every model token of every turn has the trainer's
logprob bit for bit, under preemption and prefix sharing; an observation is prefilled on top of the cached
conversation (no recompute); episodes at different turns share engine steps."""

import hashlib

import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.engine.scheduler import Scheduler
from exactrl.envs import Environment, EpisodeSettings, StepResult, run_episodes
from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.tasks.base import Example
from exactrl.train.packing import masked_completion_logprobs


class VariedObservations(Environment):
    """Answers each turn with token ids of a length between 1 and 23 that depends on what the model wrote, so
    observations differ across episodes and turns; never ends the episode (max_turns does)."""

    def step(self, turn):
        h = hashlib.sha256(bytes(t % 256 for t in turn.token_ids)).digest()
        return StepResult(observation=[32 + b % 90 for b in h[: 1 + h[0] % 23]], reward=0.5)


def _episodes(exact=True, kv_blocks=14, n=2, temperature=0.8, prefix_caching=True, stop=("\n",), record=None):
    torch.manual_seed(0)
    m = build_model(preset("tiny"), dtype=torch.float32, exact=exact, seed=0)
    eng = RolloutEngine(
        m,
        EngineConfig(
            num_kv_blocks=kv_blocks,
            prefill_chunk_size=16,
            max_num_batched_tokens=64,
            enable_prefix_caching=prefix_caching,
        ),
        tokenizer=byte_tokenizer(),
    )
    prompts = [[10 + i, 20, 30 + 2 * i, 40] * (3 + i) for i in range(3)]
    examples = [Example("p", "0") for _ in prompts]
    # In this process: these tests are about the engine (worker processes: tests/envs/test_envs.py).
    settings = EpisodeSettings(
        max_turns=4, max_tokens_per_turn=10, max_episode_tokens=160, isolation="thread"
    )
    params = SamplingParams(temperature=temperature, n=n, seed=5, stop=list(stop))
    if record is not None:  # watch every batch the scheduler makes
        orig = Scheduler.schedule

        def spy(self):
            b = orig(self)
            if b is not None:
                record.append(
                    [(e.seq, e.start, e.num_new_tokens, len(e.seq.observation_spans)) for e in b.entries]
                )
            return b

        Scheduler.schedule = spy
    try:
        batch = run_episodes(eng, eng.tokenizer, examples, prompts, VariedObservations, settings, params)
    finally:
        if record is not None:
            Scheduler.schedule = orig
    return m, batch


def _trainer_logprobs(m, episodes, temperature):
    return masked_completion_logprobs(
        m,
        [e.token_ids for e in episodes],
        [len(e.prompt_ids) for e in episodes],
        [e.loss_mask for e in episodes],
        temperature,
    )


def test_every_turn_is_exact_with_preemption_and_prefix_sharing():
    m, batch = _episodes()
    eps = [e for g in batch.groups for e in g]
    assert len(eps) == 6 and all(e.num_turns == 4 for e in eps)
    assert batch.cache["preemptions"] > 0, "the small cache was meant to force preemption"
    assert batch.cache["paused_evictions"] > 0, "and to take the blocks of episodes waiting for their env"
    assert batch.cache["fork_shared_blocks"] > 0, "the samples of a group were meant to share the prompt"
    assert (
        len({len(e.completion_ids) for e in eps}) > 1
        and len({o[1] - o[0] for e in eps for o in e.observations}) > 3
    )
    for e in eps:  # the mask is False exactly at the observations, and logprobs are 0 there
        obs = {p for s, t in e.observations for p in range(s, t)}
        assert e.loss_mask == [p not in obs for p in range(len(e.completion_ids))]
        assert not e.rollout_logprobs[[not x for x in e.loss_mask]].any()
    lps = _trainer_logprobs(m, eps, 0.8)
    n_tok = sum(sum(e.loss_mask) for e in eps)
    mismatched = sum(int((a != e.rollout_logprobs).sum()) for a, e in zip(lps, eps))
    assert n_tok > 150 and mismatched == 0
    assert all(torch.equal(a, e.rollout_logprobs) for a, e in zip(lps, eps))


def test_fast_mode_negative_control():
    """Default (non-invariant) kernels: the same comparison finds differences, so it can fail."""
    m, batch = _episodes(exact=False)
    eps = [e for g in batch.groups for e in g]
    lps = _trainer_logprobs(m, eps, 0.8)
    assert any(not torch.equal(a, e.rollout_logprobs) for a, e in zip(lps, eps))


def test_observation_is_prefilled_on_the_cached_conversation():
    """With a cache big enough for no preemption and no prefix cache to hide a recompute, the engine computes
    each token's KV once: the shared prompt once per group, every later token once per episode, except the last
    sampled one (nothing reads it). Turns end by length only (no stop strings), so no step is wasted."""
    record = []
    _, batch = _episodes(kv_blocks=200, prefix_caching=False, stop=(), record=record)
    eps = [e for g in batch.groups for e in g]
    assert batch.cache["preemptions"] == 0
    computed = sum(n for b in record for _, _, n, _ in b)
    expected = sum(len(g[0].prompt_ids) for g in batch.groups) + sum(len(e.completion_ids) - 1 for e in eps)
    assert computed == expected
    # Continuous batching across turns: some step holds episodes at different turns, and some step prefills an
    # observation while other episodes decode.
    assert any(len({t for *_, t in b}) > 1 for b in record)
    assert any(
        any(n > 1 and s > seq.num_prompt_tokens for seq, s, n, _ in b) and any(n == 1 for _, _, n, _ in b)
        for b in record
    )
