"""Decode through static buffers and CUDA graphs gives the eager engine's bits.

On the CPU the "static" mode runs the graph path's code (padded batch-size buckets, dummy rows writing into the
scratch KV page, key tables from device-side block tables, noise keys computed from device buffers) eagerly; on
a CUDA GPU (marker `gpu`) the same steps are replayed from captured graphs.
"""

from __future__ import annotations

import pytest
import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.runner import DecodeRow, ModelRunner, graph_buckets
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.train.packing import completion_logprobs

PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(3 + 5 * i)] for i in range(7)]


def _generate(model, mode: str, params: SamplingParams, **cfg):
    eng = RolloutEngine(model, EngineConfig(**cfg))
    eng.decode_mode = mode
    out = eng.generate(PROMPTS, params)
    return eng, out


def _flat(outs):
    return [(s.token_ids, s.rollout_logprobs) for o in outs for s in o.samples]


def _assert_same(a, b):
    assert len(a) == len(b)
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        assert torch.equal(la, lb)


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_buckets(256)[-3:] == [224, 240, 256]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_static_decode_equals_eager_with_forks_and_preemption(dtype):
    model = build_model(preset("tiny"), dtype=dtype, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=30, n=3, seed=5)
    cfg = dict(max_num_seqs=24, max_model_len=96, num_kv_blocks=20)
    eager, a = _generate(model, "eager", params, **cfg)
    static, b = _generate(model, "static", params, **cfg)
    assert static.stats["static_decode_steps"] > 0 and eager.stats["static_decode_steps"] == 0
    assert static.stats["ahead_steps"] > 0 and eager.stats["ahead_steps"] == 0
    assert static.stats["preemptions"] > 0, "the small cache was meant to force preemption"
    _assert_same(_flat(a), _flat(b))
    # The padding rows wrote only into the scratch page: every page the block manager hands out is identical.
    n = eager.runner.num_blocks
    for (ka, va), (kb, vb) in zip(eager.runner.kv_caches, static.runner.kv_caches):
        assert torch.equal(ka[:n], kb[:n]) and torch.equal(va[:n], vb[:n])
    assert static.runner.kv_caches[0][0][n].abs().sum() > 0, "padding rows were meant to use the scratch page"
    # The trainer agrees with the static path's recorded logprobs.
    seqs = [p + s.token_ids for p, o in zip(PROMPTS, b) for s in o.samples]
    plens = [len(p) for p, o in zip(PROMPTS, b) for _ in o.samples]
    for (_, rec), lp in zip(_flat(b), completion_logprobs(model, seqs, plens)):
        assert torch.equal(rec, lp)
    # Negative control: the comparison sees a change of seed.
    _, c = _generate(model, "static", SamplingParams(temperature=1.0, max_tokens=30, n=3, seed=6), **cfg)
    assert [t for t, _ in _flat(b)] != [t for t, _ in _flat(c)]


def test_running_ahead_with_stop_tokens_equals_eager():
    """Decode steps launched before the previous one is read back (static mode runs them on the CPU): sequences
    that draw a stop token are still in the next step, whose row for them is discarded. Same samples, same
    bits, same finish reasons as the eager engine, which reads every step back first."""
    model = build_model(preset("tiny"), dtype=torch.float32, seed=2)
    stops = list(range(3, 20))  # frequent enough that many samples stop early
    params = SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=9, stop_token_ids=stops)
    cfg = dict(max_num_seqs=16, max_model_len=96, num_kv_blocks=14)
    eager, a = _generate(model, "eager", params, **cfg)
    static, b = _generate(model, "static", params, **cfg)
    assert static.stats["ahead_steps"] > 0 and static.stats["preemptions"] > 0
    _assert_same(_flat(a), _flat(b))
    reasons = [s.finish_reason for o in b for s in o.samples]
    assert reasons == [s.finish_reason for o in a for s in o.samples]
    assert "stop" in reasons and "length" in reasons
    # Negative control: without the stop tokens the samples differ.
    _, c = _generate(model, "static", SamplingParams(temperature=1.0, max_tokens=24, n=2, seed=9), **cfg)
    assert [t for t, _ in _flat(b)] != [t for t, _ in _flat(c)]


def test_static_decode_greedy_and_live_weights():
    model = build_model(preset("tiny"), dtype=torch.float32, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    eng = RolloutEngine(model, EngineConfig(max_num_seqs=8, max_model_len=64))
    eng.decode_mode = "static"
    before = _flat(eng.generate(PROMPTS, params))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)  # in place: same addresses
    after = _flat(eng.generate(PROMPTS, params))
    assert [t for t, _ in before] != [t for t, _ in after]
    _, ref = _generate(model, "eager", params, max_num_seqs=8, max_model_len=64)
    _assert_same(after, _flat(ref))


def test_decode_rejects_rows_past_the_model_length():
    model = build_model(preset("tiny"), dtype=torch.float32, seed=0)
    runner = ModelRunner(model, 8, 16, max_num_seqs=4, max_model_len=32, decode_mode="static")
    with pytest.raises(ValueError, match="max_model_len 32"):
        runner.decode([DecodeRow(5, 40, [0, 1, 2], 0, 0, 0)])
    with pytest.raises(ValueError, match="1 .. 4 rows"):
        runner.decode([DecodeRow(5, 1, [0], 0, i, 0) for i in range(5)])
    with pytest.raises(RuntimeError, match="pending but names no previous output row"):
        runner.decode([DecodeRow(-1, 1, [0], 0, 0, 0)])
    with pytest.raises(ValueError, match="needs a model on a CUDA device"):
        ModelRunner(model, 8, 16, decode_mode="graph")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("exact", [True, False])
def test_cuda_graph_decode_equals_eager_on_gpu(exact):
    from exactrl.ops import set_exact_environment

    set_exact_environment(exact)
    cfg = preset("tiny")
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, exact=exact, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=40, n=3, seed=5)
    sizes = dict(max_num_seqs=24, max_model_len=128, num_kv_blocks=24)
    eager, a = _generate(model, "eager", params, **sizes)
    graph, b = _generate(model, "graph", params, **sizes)
    assert graph.stats["cuda_graph_steps"] > 0 and graph.runner.num_graphs == len(graph_buckets(24))
    assert graph.stats["ahead_steps"] > 0
    assert graph.stats["preemptions"] > 0
    _assert_same(_flat(a), _flat(b))
    if exact:  # and the trainer agrees with what the graphs recorded
        seqs = [p + s.token_ids for p, o in zip(PROMPTS, b) for s in o.samples]
        plens = [len(p) for p, o in zip(PROMPTS, b) for _ in o.samples]
        for (_, rec), lp in zip(_flat(b), completion_logprobs(model, seqs, plens)):
            assert torch.equal(rec, lp)
    # Greedy (a second graph kind) and top-k (forward-only graphs, then the torch sampler) agree with eager too.
    for other in (
        SamplingParams(temperature=0.0, max_tokens=20),
        SamplingParams(temperature=0.8, top_k=50, max_tokens=20, seed=3),
        # stop tokens: steps launched ahead hold sequences that have already stopped
        SamplingParams(temperature=1.0, max_tokens=30, n=3, seed=4, stop_token_ids=list(range(3, 20))),
    ):
        _assert_same(
            _flat(graph.generate(PROMPTS, other)), _flat(_generate(model, "eager", other, **sizes)[1])
        )
    # Every bucket of 24 for each of the three kinds: the greedy and top-k calls (7 sequences) capture up to the
    # pool's high mark (24, the first call's), reusing its blocks.
    assert graph.runner.num_graphs == 3 * len(graph_buckets(24))
    # A fresh engine: a 7-sequence greedy call captures the buckets up to 8; a 21-sequence call of another kind goes
    # past the pool's high mark, so every graph goes and the pool starts again with that kind's 24 buckets; the
    # greedy kind comes back up to the new mark. The bits stay the eager engine's throughout.
    small = len([b for b in graph_buckets(24) if b <= 8])
    fresh = RolloutEngine(model, EngineConfig(**sizes))
    fresh.decode_mode = "graph"
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    eager_eng = RolloutEngine(model, EngineConfig(**sizes))
    eager_eng.decode_mode = "eager"
    _assert_same(_flat(fresh.generate(PROMPTS, greedy)), _flat(eager_eng.generate(PROMPTS, greedy)))
    assert fresh.runner.num_graphs == small
    _assert_same(_flat(fresh.generate(PROMPTS, params)), _flat(a))
    assert fresh.runner.num_graphs == len(graph_buckets(24))
    _assert_same(_flat(fresh.generate(PROMPTS, greedy)), _flat(eager_eng.generate(PROMPTS, greedy)))
    assert fresh.runner.num_graphs == 2 * len(graph_buckets(24))
    # Live weights: an in-place update is seen by the captured graphs; a reallocation triggers a recapture.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.25)
    after = _flat(graph.generate(PROMPTS, params))
    assert [t for t, _ in after] != [t for t, _ in _flat(b)]
    _assert_same(after, _flat(_generate(model, "eager", params, **sizes)[1]))
    old = graph.runner._static
    model.load_state_dict({k: v.clone() * 0.5 for k, v in model.state_dict().items()}, assign=True)
    again = _flat(graph.generate(PROMPTS, params))
    assert graph.runner._static is not old
    _assert_same(again, _flat(_generate(model, "eager", params, **sizes)[1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fetch_and_upload_do_not_wait_for_the_gpu():
    """The pipeline's host-device copies are queued behind the running step; none of them blocks the host."""
    import numpy as np

    from exactrl.ops.batch import upload_int64

    model = build_model(preset("tiny"), device="cuda", dtype=torch.bfloat16, seed=0)
    runner = ModelRunner(model, 8, 16, max_num_seqs=8, max_model_len=64, decode_mode="graph")
    stream = torch.cuda.current_stream()
    for rows in (8, 3):  # all of a bucket's rows, and a strided view of some of them
        out = torch.arange(16, dtype=torch.float64, device="cuda").view(2, 8)[:, :rows]
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)  # keeps the stream busy for ~0.2 s
        res = runner.fetch(out)
        (ids,) = upload_int64([np.arange(5, dtype=np.int64)], "cuda")
        assert not stream.query(), "fetch() or upload_int64() waited for the GPU"
        assert res.result() == (list(range(rows)), [float(8 + i) for i in range(rows)])
        assert ids.tolist() == list(range(5))
    # Negative control: a plain copy to pageable memory does wait, and the check sees it.
    torch.cuda._sleep(300_000_000)
    torch.empty(3, dtype=torch.float64).copy_(out[0])
    assert stream.query()


def test_release_graphs_frees_the_runner_without_the_cycle_collector():
    """A runner and its static decode state refer to each other: dropped alone, they (the KV cache, a split
    engine's graphs with their NCCL collectives) wait for the cycle collector, which may run after the process
    group is destroyed. `release_graphs` breaks the cycle: the runner goes when its last reference does, and the
    next decode builds the state again with the same bits."""
    import gc
    import weakref

    model = build_model(preset("tiny"), dtype=torch.float32, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=3)
    gc.disable()
    try:
        for release in (False, True):
            eng, out = _generate(model, "static", params, max_num_seqs=8, max_model_len=64)
            assert eng.runner._static is not None
            ref = weakref.ref(eng.runner)
            if release:
                eng.runner.release_graphs()
                assert eng.runner._static is None
                again = _flat(eng.generate(PROMPTS, params))  # the state is built again
                _assert_same(again, _flat(out))
                eng.runner.release_graphs()
            del eng
            assert (ref() is None) == release  # without the release (the control) the cycle keeps it
    finally:
        gc.enable()
        gc.collect()
