"""The layer probe inside a mixture of experts: for a planted fault on the engine's path only (the engine's copy of
the weights differing from the trainer's, as a broken weight sync would leave it), the probe names the first
differing layer and, in that sparse layer, whether the router picked different experts (which token, which
experts) or the same experts gave different bits (which expert); `exactrl parity --replay` reports it.

Faults: every weight of one expert's down projection one ulp up; one router row flipped (the experts change); every
router weight one ulp up (the same experts, other routing weights); the attention output projection one ulp up (the
difference comes in before the router). Clean: nothing differs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

import exactrl.model.loading as loading
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.guard import MismatchSequence, write_mismatch_report
from exactrl.guard.layers import probe_layers
from exactrl.guard.replay import replay_report
from exactrl.model.moe import collect_router_outputs
from exactrl.train.packing import PackedBatch, completion_logprobs

LAYER = 2  # a sparse layer of tiny-moe (layer 0 is dense)
PROMPT = [5, 17, 33, 2, 9, 40, 41, 42, 7, 7, 100, 250]
COMPLETION = [3, 1, 4, 1, 5, 9, 26, 53]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    m, _ = loading.load_policy(preset_name="tiny-moe", device="cpu", dtype="float32", seed=3)
    return m.requires_grad_(False)


def _busiest_expert(model, completion: list[int] = COMPLETION) -> int:
    """The expert of layer LAYER that the most tokens of the probed sequence use (a clean forward)."""
    seq = PROMPT + completion
    pb = PackedBatch.build([seq], [len(PROMPT)])
    with torch.no_grad(), collect_router_outputs(model) as rec:
        model(pb.input_ids, pb.batch.q_pos, pb.batch)
    (ids,) = [r.ids for r in rec.records if r.layer == LAYER]
    return Counter(ids.flatten().tolist()).most_common(1)[0][0]


def _on_engine_path(model, layer: int, param: Callable, change: Callable) -> Callable[[], None]:
    """While layer `layer` runs on the engine's path (it gets a KV cache), the tensor `param(layer_module)` holds
    `change(original)`; the trainer's path sees the original. Returns a function that removes the plant."""
    mod = model.model.layers[layer]
    kept = {}

    def pre(m, args):
        if args[6] is not None:  # DecoderLayer.forward(ops, pending, h, positions, cos_sin, batch, kv_cache)
            p = param(m)
            kept["data"] = p.data
            p.data = change(p.data.clone())

    def post(m, args, out):
        if "data" in kept:
            param(m).data = kept.pop("data")

    handles = [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    return lambda: [h.remove() for h in handles]


def _ulp_up(t: torch.Tensor) -> torch.Tensor:
    return torch.nextafter(t, torch.full_like(t, float("inf")))


def _scaled_up(t: torch.Tensor) -> torch.Tensor:
    """Every element times (1 + 2^-7): far above an ulp, so every nonzero product it enters changes its bits on any
    machine (a one-ulp bump can round away on one CPU and not on another)."""
    return t * (1 + 2**-7)


def _probe_planted(model, undo: Callable[[], None], completion: list[int] = COMPLETION):
    """probe_layers with a plant in place, removed afterwards; fails as "the plant did not take" when the engine's
    and the trainer's final hidden states came out equal (then nothing below can be about the probe)."""
    try:
        p = probe_layers(model, PROMPT, completion)
    finally:
        undo()
    if p.final_equal and p.layer is None:
        pytest.fail(f"the plant did not take: the engine's path gave the trainer's bits ({p.describe()})")
    return p


def test_clean_moe_model_agrees_at_every_layer(model):
    p = probe_layers(model, PROMPT, COMPLETION)
    assert p.layer is None and p.final_equal and p.experts is None


def test_a_change_in_one_experts_weights_names_that_expert(model):
    e = _busiest_expert(model)

    def bump(w):
        w[e] = _scaled_up(w[e])
        return w

    p = _probe_planted(model, _on_engine_path(model, LAYER, lambda m: m.mlp.experts.down, bump))
    assert p.layer == LAYER, p.describe()
    x = p.experts
    assert x is not None and x.finding == "expert" and x.expert == e, p.describe()
    assert e in x.engine_experts and x.engine_experts == x.trainer_experts
    assert x.token_id == (PROMPT + COMPLETION)[x.position]
    assert f"expert {e} gave different bits at position {x.position}" in p.describe()


def test_a_changed_router_names_the_token_and_both_sides_experts(model):
    e = _busiest_expert(model)
    undo = _on_engine_path(
        model,
        LAYER,
        lambda m: m.mlp.gate.weight,
        lambda w: torch.cat([w[:e], -w[e : e + 1] * 50, w[e + 1 :]]),
    )
    p = _probe_planted(model, undo)
    assert p.layer == LAYER, p.describe()
    x = p.experts
    assert x is not None and x.finding == "routing", p.describe()
    # The first token that used expert e now goes elsewhere on the engine's side.
    assert e in x.trainer_experts and e not in x.engine_experts
    assert f"engine experts {x.engine_experts}, trainer experts {x.trainer_experts}" in p.describe()


def test_router_weights_one_ulp_off_with_the_same_experts_are_named(model):
    """Every router weight one ulp up: the logits move, the top-k does not (here): the routing weights differ."""
    p = _probe_planted(model, _on_engine_path(model, LAYER, lambda m: m.mlp.gate.weight, _ulp_up))
    assert p.layer == LAYER and p.experts is not None, p.describe()
    assert p.experts.finding == "router_logits" and p.experts.engine_experts == p.experts.trainer_experts
    assert "the router picked the same experts for every token, but its logits differ" in p.describe()


def test_a_fault_before_the_router_is_not_blamed_on_the_experts(model):
    p = _probe_planted(model, _on_engine_path(model, LAYER, lambda m: m.self_attn.o_proj.weight, _scaled_up))
    assert p.layer == LAYER and p.experts is not None and p.experts.finding == "input", p.describe()


def test_replay_of_an_moe_mismatch_names_the_expert(tmp_path, model, monkeypatch):
    """A mismatch report of tiny-moe, replayed with the expert fault planted in the loaded model's engine path:
    the replay's lines and its structured result name the layer and the expert."""
    from exactrl.config import config_from_dict
    from exactrl.model.tokenizer import byte_tokenizer

    cfg = config_from_dict(
        {
            "run": {"device": "cpu", "exact": True, "tensorboard": False, "report": False, "progress": False},
            "model": {"preset": "tiny-moe", "dtype": "float32"},
            "engine": {"block_size": 16, "max_model_len": 64},
            "sampling": {"temperature": 0.7, "max_tokens": 6},
            "task": {"max_prompt_tokens": 16},
            "algorithm": {"group_size": 2, "rollouts_per_step": 2},
        }
    )
    cfg.validate()
    tok = byte_tokenizer()
    params = SamplingParams(temperature=0.7, max_tokens=6, n=1, seed=5)
    (out,) = RolloutEngine(model, EngineConfig(max_model_len=64)).generate([PROMPT], params, request_ids=[9])
    smp = out.samples[0]
    (trainer_lp,) = completion_logprobs(model, [PROMPT + smp.token_ids], [len(PROMPT)], 0.7)
    seq = MismatchSequence(9, 0, PROMPT, smp.token_ids, smp.rollout_logprobs.float().cpu(), trainer_lp)
    d = write_mismatch_report(
        tmp_path, 4, cfg=cfg, model=model, tokenizer=tok, sequences=[seq], sampling=params, probe_layers=False
    )
    e = _busiest_expert(model, smp.token_ids)
    real = loading.load_policy

    def bump(w):
        w[e] = _scaled_up(w[e])
        return w

    # The plant must change what the replay compares (the engine's logprobs of the report's sequence), or the
    # test would assert about a replay that had nothing to find.
    p = _probe_planted(
        model, _on_engine_path(model, LAYER, lambda m: m.mlp.experts.down, bump), smp.token_ids
    )
    if p.final_equal:
        pytest.fail(f"the plant did not take: the final hidden states are equal ({p.describe()})")

    def load_with_fault(**kw):
        m, t = real(**kw)
        _on_engine_path(m, LAYER, lambda mod: mod.mlp.experts.down, bump)
        return m, t

    monkeypatch.setattr(loading, "load_policy", load_with_fault)
    res = replay_report(d)
    (s,) = res.sequences
    assert not res.ok and s.layer == LAYER, res.text()
    assert s.experts is not None and s.experts["finding"] == "expert" and s.experts["expert"] == e, res.text()
    assert f"expert {e} gave different bits" in res.text()
