"""Which path an expert-parallel engine's decode takes (issue 55, item 8), on an engine split over 2 ranks simulated
in one process (tests/distributed/_ep_sim.py), top-4 routing over trained-looking weights.

`ExpertParallelExperts` computes a rank's slots by count (`nonzero`, a host synchronisation) in prefill and eager
calls, and every slot the static way inside the engine's static decode step and any CUDA graph capture (a host
synchronisation cannot be captured; exactrl/distributed/expert_parallel.py). On the CPU the engine's "static" decode
mode runs the graph path's code eagerly: every decode step must take the static path (every slot handed to the
experts op) and every prefill the by-count one, and the samples must be the one-device engine's bit for bit. On a
GPU (marker `gpu`) the engine captures its decode steps in CUDA graphs: every forward run under the capture must
take the static path, the decode steps must replay graphs, and the samples must be the one-device engine's."""

from __future__ import annotations

import pytest
import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset

from ._ep_sim import split_model
from ._tp_driver import trained_looking

PROMPTS = [[(5 * i + j) % 500 + 3 for j in range(2 + 7 * i)] for i in range(3)]
PARAMS = SamplingParams(temperature=0.8, max_tokens=5, n=2, seed=5)


def _model(device: str):
    # Built on its device: the device picks the exact ops (torch on the CPU, Triton on CUDA); a CPU model moved to
    # CUDA would keep the CPU ops, whose expert grouping reads counts back to the host (not capturable).
    model = build_model(preset("tiny-moe", num_experts_per_tok=4), device=device, exact=True)
    trained_looking(model, seed=3)
    return model.requires_grad_(False)


def _generate(model, mode: str):
    engine = RolloutEngine(model, EngineConfig(block_size=16, num_kv_blocks=16, max_model_len=64))
    engine.decode_mode = mode
    outs = engine.generate(PROMPTS, PARAMS)
    assert not any(o.error for o in outs)
    return [(s.token_ids, s.rollout_logprobs.cpu()) for o in outs for s in o.samples], engine.stats


def _same(a, b) -> bool:
    return len(a) == len(b) and all(ta == tb and torch.equal(la, lb) for (ta, la), (tb, lb) in zip(a, b))


def test_static_decode_takes_every_slot_and_prefill_counts_on_cpu():
    model = _model("cpu")
    one, _ = _generate(model, "static")
    split, calls = split_model(model, 2, 1)
    got, stats = _generate(split, "static")
    assert _same(got, one)
    decode = [c for c in calls if c.static]
    prefill = [c for c in calls if not c.static]
    assert stats["static_decode_steps"] > 0 and decode and prefill, stats
    assert all(c.rows == c.slots for c in decode), decode  # every slot: no data-dependent shape
    assert sum(c.rows for c in prefill) < sum(c.slots for c in prefill)  # this rank's slots alone
    # Eager decode (no static step): by count throughout, the same bits.
    split, calls = split_model(model, 2, 0)
    got, stats = _generate(split, "eager")
    assert _same(got, one) and stats["static_decode_steps"] == 0 and not any(c.static for c in calls)


@pytest.mark.gpu
def test_graph_capture_of_an_expert_parallel_decode_takes_the_static_path():
    model = _model("cuda")
    one, _ = _generate(model, "graph")
    split, calls = split_model(model, 2, 0)
    got, stats = _generate(split, "graph")
    captured = [c for c in calls if c.capturing]
    assert stats["cuda_graph_steps"] > 0 and captured, stats  # the decode steps replayed graphs
    assert all(c.static and c.rows == c.slots for c in captured), captured
    assert _same(got, one)
