"""The rollout engine end to end on a tiny model: exact parity with the trainer under prefix sharing, chunked
prefill and preemption; reproducible sampling; live weights; bad input."""

import pytest
import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.model.tokenizer import byte_tokenizer
from exactrl.parity import run_parity
from exactrl.train.packing import completion_logprobs


def _model(dtype=torch.float32, exact=True, seed=0):
    return build_model(preset("tiny"), dtype=dtype, exact=exact, seed=seed)


# fp32 at T = 1 and bf16 at T = 0.7 by default; the other two pairs are `extended` (make test-all).
@pytest.mark.parametrize(
    "temperature,dtype",
    [
        pytest.param(1.0, torch.float32, id="1.0-float32"),
        pytest.param(1.0, torch.bfloat16, marks=pytest.mark.extended, id="1.0-bfloat16"),
        pytest.param(0.7, torch.float32, marks=pytest.mark.extended, id="0.7-float32"),
        pytest.param(0.7, torch.bfloat16, id="0.7-bfloat16"),
    ],
)
def test_exact_parity_with_sharing_chunking_preemption(temperature, dtype):
    r = run_parity(
        _model(dtype),
        num_prompts=6,
        max_tokens=40,
        temperature=temperature,
        seed=1,
        samples_per_prompt=2,
        kv_blocks=12,
        prefill_chunk=16,
        prompt_vocab=259,
    )
    assert r.num_tokens >= 6 * 2 * 40 * 3
    assert r.preemptions > 0, "the small cache was meant to force preemption"
    assert r.num_mismatched == 0 and r.max_abs_diff == 0.0
    assert r.tokens_identical_across_compositions


def test_fast_mode_negative_control():
    """Without the invariant ops the same check finds differences: proof that it can fail."""
    r = run_parity(
        _model(exact=False), num_prompts=6, max_tokens=40, temperature=1.0, seed=1, prompt_vocab=259
    )
    assert r.mode == "fast"
    assert r.num_mismatched > 0 and r.max_abs_diff > 0


def test_greedy_is_argmax_of_the_trainers_logits():
    m = _model()
    eng = RolloutEngine(m, EngineConfig())
    prompt = [10, 20, 30, 40]
    out = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0].samples[0]
    seq = prompt + out.token_ids
    for t in range(len(prompt), len(seq)):  # each greedy token is the argmax given its prefix
        ctx = torch.tensor(seq[:t])
        from exactrl.ops import AttentionBatch

        b = AttentionBatch.packed([t])
        with torch.no_grad():
            h = m(ctx, b.q_pos, b)
            z = m.logits(h[-1:], 1.0)
        assert int(z.argmax()) == seq[t]
    lps = completion_logprobs(m, [seq], [len(prompt)])[0]
    assert torch.equal(lps, out.rollout_logprobs)


def test_same_seed_same_tokens_other_seed_other_tokens():
    m = _model()
    eng = RolloutEngine(m, EngineConfig())
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    a = eng.generate(prompts, SamplingParams(max_tokens=16, seed=3, n=3))
    b = eng.generate(prompts[::-1], SamplingParams(max_tokens=16, seed=3, n=3), request_ids=[1, 0])
    c = eng.generate(prompts, SamplingParams(max_tokens=16, seed=4, n=3))
    toks = lambda outs: [[s.token_ids for s in o.samples] for o in outs]  # noqa: E731
    assert toks(a) == toks(b[::-1])
    assert toks(a) != toks(c)
    assert len({tuple(s.token_ids) for s in a[0].samples}) > 1, "the n samples of a group must differ"


def test_live_weights_change_generations_and_parity_holds():
    m = _model()
    eng = RolloutEngine(m, EngineConfig())
    prompts = [[7, 8, 9], [1, 1, 2, 3, 5]]
    params = SamplingParams(max_tokens=24, seed=0, n=2)
    before = eng.generate(prompts, params)
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    seqs = [p + s.token_ids for p, o in zip(prompts, before) for s in o.samples]
    plens = [len(p) for p, o in zip(prompts, before) for _ in o.samples]
    from exactrl.train.packing import PackedBatch

    pb = PackedBatch.build(seqs, plens)
    h = m(pb.input_ids, pb.batch.q_pos, pb.batch)
    lp, _ = m.logprobs(h, pb.targets)
    (-lp[pb.response_mask].mean()).backward()
    opt.step()  # weights change in place: the engine holds the same module
    after = eng.generate(prompts, params)
    assert [s.token_ids for o in before for s in o.samples] != [s.token_ids for o in after for s in o.samples]
    seqs = [p + s.token_ids for p, o in zip(prompts, after) for s in o.samples]
    lps = completion_logprobs(m, seqs, plens)
    for rec, lp in zip([s.rollout_logprobs for o in after for s in o.samples], lps):
        assert torch.equal(rec, lp)


def test_bad_input_is_per_request():
    m = _model()
    eng = RolloutEngine(m, EngineConfig(max_model_len=32))
    outs = eng.generate([[1, 2, 3], [], list(range(40)), [5, 6]], SamplingParams(max_tokens=8))
    assert outs[0].error is None and len(outs[0].samples[0].token_ids) == 8
    assert outs[1].error == "empty prompt"
    assert "exceeds max_model_len" in outs[2].error and not outs[2].samples
    assert outs[3].error is None
    assert eng.generate([], SamplingParams()) == []
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([[1]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([[1]], SamplingParams(temperature=-1.0))


def test_stop_string_spanning_tokens():
    """A byte tokenizer makes every character its own token, so a 2-character stop string spans tokens."""
    tok = byte_tokenizer()
    m = build_model(preset("tiny", vocab_size=tok.vocab_size), seed=0)  # every id decodes to text
    eng = RolloutEngine(m, EngineConfig(), tokenizer=tok)
    free = eng.generate([tok.encode("ab")], SamplingParams(max_tokens=40, seed=5))[0].samples[0]
    text = tok.decode(free.token_ids)
    stop = text[10:12]  # whatever the model writes at characters 10-11
    out = eng.generate([tok.encode("ab")], SamplingParams(max_tokens=40, seed=5, stop=[stop]))[0].samples[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop) + len(stop)]  # cut right after the first occurrence
    assert out.token_ids == free.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(free.token_ids)


def test_stop_token_ends_sample():
    m = _model()
    eng = RolloutEngine(m, EngineConfig())
    free = eng.generate([[3, 4]], SamplingParams(max_tokens=30, seed=2))[0].samples[0]
    stop_tok = free.token_ids[5]
    out = eng.generate([[3, 4]], SamplingParams(max_tokens=30, seed=2, stop_token_ids=[stop_tok]))[0].samples[
        0
    ]
    first = free.token_ids.index(stop_tok)
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]


def test_fp32_lm_head_parity():
    """bf16 model, LM head and softmax in fp32 on both sides: still bitwise equal, and not the bf16 head."""
    m = build_model(preset("tiny"), dtype=torch.bfloat16, seed=0, fp32_lm_head=True)
    r = run_parity(m, num_prompts=3, max_tokens=24, temperature=1.0, seed=2, prompt_vocab=259)
    assert r.num_mismatched == 0 and r.num_tokens > 0
    h = torch.randn(4, m.config.hidden_size).to(torch.bfloat16)
    t = torch.tensor([1, 2, 3, 4])
    lp32, _ = m.logprobs(h, t)
    m.fp32_lm_head = False
    lp16, _ = m.logprobs(h, t)
    assert not torch.equal(lp32, lp16)


def test_trace_counts_running_and_waiting_sequences_per_step():
    """engine.trace (off by default) gets one (step, time, running, waiting) per engine step: one prefill step
    of the group parents, then decode steps of their forks until max_tokens."""
    m = _model()
    eng = RolloutEngine(m, EngineConfig())
    params = SamplingParams(max_tokens=4, n=2, seed=0)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
    eng.generate(prompts, params)
    assert eng.trace is None
    eng.trace = []
    eng.reset_stats()
    eng.generate(prompts, params)
    assert [(s, r, w) for s, _, r, w in eng.trace] == [(0, 3, 0), (1, 6, 0), (2, 6, 0), (3, 6, 0)]
    times = [t for _, t, _, _ in eng.trace]
    assert times == sorted(times)
    # Fewer slots than samples: a prompt waits while the first groups run, and the trace says so.
    eng = RolloutEngine(m, EngineConfig(max_num_seqs=3))
    eng.trace = []
    eng.generate(prompts, params)
    counts = [(r, w) for _, _, r, w in eng.trace]
    assert counts[0] == (2, 1) and counts[1][1] == 1 and counts[-1][1] == 0, counts
    assert [s for s, _, _, _ in eng.trace] == list(range(int(eng.stats["steps"])))


def test_engine_steps_launch_inside_the_pdl_scope_and_training_outside():
    """The engine's forwards (prefill and decode) run inside `pdl_launches` (programmatic dependent launch for
    its kernels on Hopper); a forward outside the engine (the trainer's) does not, and a step that raises leaves
    the scope as it found it."""
    from exactrl.ops.triton import common

    model = _model()
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(getattr(common._SCOPE, "on", False)))
    eng = RolloutEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64))
    eng.generate([[5, 6, 7], [5, 6, 8]], SamplingParams(temperature=0.7, max_tokens=6, seed=1))
    assert len(seen) > 2 and all(seen)
    seen.clear()
    completion_logprobs(model, [[5, 6, 7, 8]], [3])  # the trainer's forward
    assert seen == [False]
    model.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("planted")))
    with pytest.raises(RuntimeError, match="planted"):
        eng.generate([[9, 9, 9]], SamplingParams(max_tokens=2))
    assert not getattr(common._SCOPE, "on", False)


def test_engine_steps_run_with_torch_determinism_off_and_restore_it():
    """The RL loop turns torch's deterministic algorithms on in exact mode (for the trainer's backward); the
    engine's steps run with them off (on a GPU they turned each KV-cache write into a sort and every
    torch.empty into a fill) and leave the mode as it was, warn_only included, also when a step raises."""
    model = _model()
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(torch.are_deterministic_algorithms_enabled()))
    eng = RolloutEngine(model, EngineConfig(max_num_seqs=4, max_model_len=64))
    params = SamplingParams(temperature=0.7, max_tokens=6, seed=1)
    prompts = [[5, 6, 7], [5, 6, 8]]
    before = eng.generate(prompts, params)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        after = eng.generate(prompts, params)
        assert seen and not any(seen)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        # The same tokens and recorded logprobs either way.
        for a, b in zip(before, after):
            assert a.samples[0].token_ids == b.samples[0].token_ids
            assert torch.equal(a.samples[0].rollout_logprobs, b.samples[0].rollout_logprobs)
        model.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("planted")))
        with pytest.raises(RuntimeError, match="planted"):
            eng.generate([[9, 9, 9]], params)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
