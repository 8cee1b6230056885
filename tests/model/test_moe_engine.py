"""The MoE presets end to end on the CPU: `exactrl parity --preset tiny-moe` (engine logprobs bitwise equal to the
trainer's under prefix sharing, copy-on-write, chunked prefill and preemption; the fast backend differs), the
Qwen2-MoE preset through the same check in bf16, and the trainer's router choosing, by itself, the very experts the
engine chose for every token (no routing replay)."""

import json

import pytest
import torch

from exactrl.cli import main
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.model.moe import SparseMoeBlock
from exactrl.ops import AttentionBatch
from exactrl.ops.torch_ops import ExactTorchOps
from exactrl.parity import run_parity

PARITY = [
    "parity",
    "--preset",
    "tiny-moe",
    "--device",
    "cpu",
    "--num-prompts",
    "3",
    "--max-tokens",
    "6",
    "--json",
]


def _record(capsys) -> dict:
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("{")]
    return json.loads(line)


@pytest.mark.slow  # two engine runs under four batch compositions: about 20 s of CPU
def test_parity_cli_tiny_moe_exact_and_fast(capsys):
    assert main(PARITY) == 0
    rec = _record(capsys)
    assert rec["num_tokens"] > 0 and rec["num_mismatched"] == 0 and rec["max_abs_diff"] == 0.0
    assert rec["tokens_identical_across_compositions"]
    for key in ("preemptions", "prefix_hit_blocks", "fork_shared_blocks", "cow_copies"):
        assert rec[key] > 0, key
    # Negative control: PyTorch's default kernels (unpadded per-expert GEMMs, model-dtype combine) differ.
    assert main([*PARITY, "--mode", "fast"]) == 1
    rec = _record(capsys)
    assert rec["mode"] == "fast" and rec["num_mismatched"] > 0


def test_qwen2_moe_engine_parity_bf16_with_preemption_and_sharing():
    model = build_model(preset("tiny-qwen2-moe"), dtype=torch.bfloat16, seed=3)
    r = run_parity(
        model,
        num_prompts=3,
        max_tokens=10,
        temperature=1.0,
        seed=2,
        samples_per_prompt=2,
        kv_blocks=10,
        prefill_chunk=16,
        prompt_vocab=259,
        microbatch_tokens=(48, 1 << 30),
    )
    assert r.preemptions > 0 and r.fork_shared_blocks > 0
    assert r.num_mismatched == 0 and r.max_abs_diff == 0.0 and r.tokens_identical_across_compositions


class _RoutingRecorder(ExactTorchOps):
    """The exact ops, recording each moe_route call's expert ids in call order."""

    def __init__(self):
        self.calls: list[torch.Tensor] = []

    def moe_route(self, logits, top_k, norm_topk_prob):
        weights, ids = super().moe_route(logits, top_k, norm_topk_prob)
        self.calls.append(ids.clone())
        return weights, ids


def test_trainer_router_picks_the_engines_experts_without_replay():
    """Every token's experts in every sparse layer, as the engine chose them while sampling (the prompt in prefill
    chunks, then one row per decode step), equal the trainer's own choice in one packed forward, token by token."""
    model = build_model(preset("tiny-moe"), seed=1)
    with torch.no_grad():  # a router that spreads its tokens: many distinct expert choices to compare
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.gate.weight.mul_(10.0)
    rec = _RoutingRecorder()
    model.set_ops(rec)
    positions: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda m, args: positions.append(args[1].clone()))
    sparse = sum(isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers)
    prompt = [5, 17, 99, 3, 41, 8, 250, 77, 12, 60, 31, 200, 9, 140, 66, 2, 180, 45]
    engine = RolloutEngine(model, EngineConfig(prefill_chunk_size=8))
    out = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, seed=5))
    seq = prompt + out[0].samples[0].token_ids
    # Each engine forward runs the sparse layers in order: call j of a forward is sparse layer j.
    assert len(rec.calls) == sparse * len(positions) and len(positions) > 3
    pos = torch.cat(positions)
    order = torch.argsort(pos)
    assert torch.equal(pos[order], torch.arange(len(seq) - 1)), "the engine fed every token but the last once"
    engine_ids = [torch.cat(rec.calls[j::sparse])[order] for j in range(sparse)]
    rec.calls.clear()
    batch = AttentionBatch.packed([len(seq)])
    with torch.no_grad():
        model(torch.tensor(seq), batch.q_pos, batch)
    for j in range(sparse):
        assert torch.equal(engine_ids[j], rec.calls[j][:-1]), f"sparse layer {j}"
    assert len({tuple(r) for r in engine_ids[0].tolist()}) > 4, "routing too uniform to show anything"
