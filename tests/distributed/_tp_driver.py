"""What tests/distributed/test_tensor_parallel.py launches on 2 ranks (torchrun, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/_tp_driver.py SPEC.json

SPEC.json: {"jobs": [job, ...], "out": FILE.json (default tp.json in the working directory)}. For each job {"preset": NAME, "dtype": "float32" | "bfloat16",
"overrides": {field: value}, "lora": [target, ...] (LoRA adapters on those projections, B non-zero)} every rank
builds the same model
with trained-looking weights, samples ragged prompts with the one-device engine (tensor_parallel 1, the whole model
on this rank) and with the engine split over both ranks (tensor_parallel 2), eagerly and through the static decode
buffers, and with a negative control: the same split but o_proj / down_proj as Megatron's row-parallel layers (K
split over the ranks, partial sums all-reduced). It also loads full weights from another model into a shard through
`shard_full_weight` (the weight sync's way in). Rank 0 writes what it saw; every rank asserts that the ranks of the
split engine agree with each other.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from exactrl.distributed.expert_parallel import ExpertParallelExperts, shard_experts
from exactrl.distributed.tensor_parallel import (
    GatheredLinear,
    TensorParallelGroup,
    row_parallel_reference,
    shard_engine_model,
    tensor_parallel_groups,
)
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model import build_model, preset
from exactrl.model.lora import LoraSpec, add_lora
from exactrl.ops import Ops

PROMPT_LENS = (1, 5, 17, 33, 2, 9)  # ragged: one token, a chunk and a half, past two KV blocks
N, MAX_TOKENS, TEMPERATURE = 2, 12, 0.8


@torch.no_grad()
def trained_looking(model: nn.Module, seed: int) -> None:
    """Weights a trained model might have rather than init's near-uniform logits: matrices normal with std
    1/sqrt(fan_in) (so activations keep their scale and the logits are peaked), norm weights around 1, biases
    small and non-zero. The same values on every rank (one CPU generator)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)


class PartialCombineExperts(ExpertParallelExperts):
    """The expert-parallel negative control: each rank combines its own experts' weighted outputs, rounds that
    partial sum to the model dtype and the ranks all-reduce the partials (a combine split over the ranks)."""

    def forward(self, ops: Ops, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        per = self.gate_up.shape[0]
        local = ids - self.first_expert
        own = (local >= 0) & (local < per)
        acc = torch.zeros(x.shape, dtype=torch.float32)
        for r in range(ids.shape[1]):
            rows = own[:, r].nonzero()[:, 0]
            if rows.numel():
                ones = torch.ones(rows.numel(), 1, dtype=torch.float32)
                o = ops.moe_experts(x[rows], self.gate_up, self.down, ones, local[rows, r, None])
                acc[rows] = acc[rows] + weights[rows, r, None] * o.float()
        out = acc.to(x.dtype)
        dist.all_reduce(out, group=self.group.group)
        return out


def expert_control(full: nn.Module, tp: TensorParallelGroup) -> nn.Module:
    model = shard_experts(copy.deepcopy(full), tp)
    for m in model.modules():
        if isinstance(m, ExpertParallelExperts):
            m.__class__ = PartialCombineExperts
    return model


def generate(model, prompts, decode_mode: str = "eager"):
    cfg = EngineConfig(block_size=16, num_kv_blocks=10, prefill_chunk_size=16, max_num_batched_tokens=40)
    engine = RolloutEngine(model, cfg)
    engine.decode_mode = decode_mode
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=3, n=N)
    outs = engine.generate(prompts, params)
    assert not any(o.error for o in outs), [o.error for o in outs]
    tokens = [s.token_ids for o in outs for s in o.samples]
    logprobs = [s.rollout_logprobs for o in outs for s in o.samples]
    return tokens, logprobs, int(engine.stats["preemptions"])


def compare(a, b) -> dict:
    """tokens equal?, logprobs torch.equal?, how many logprobs differ (of the common prefix of each sample)."""
    same_tokens = a[0] == b[0]
    differ = total = 0
    for x, y in zip(a[1], b[1]):
        n = min(len(x), len(y))
        differ += int((x[:n] != y[:n]).sum())
        total += n
    lp_equal = same_tokens and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    return {"tokens_equal": same_tokens, "logprobs_equal": lp_equal, "differ": differ, "total": total}


def adapters_off(model: nn.Module) -> nn.Module:
    """The LoRA control: a split engine whose o_proj / down_proj drop their adapters (a GatheredLinear that
    carries no LoRA, as before adapters were split)."""
    for m in model.modules():
        if isinstance(m, GatheredLinear):
            m.lora = None
    return model


def run_job(job: dict, tp: TensorParallelGroup) -> dict:
    dtype = getattr(torch, job["dtype"])
    cfg = preset(job["preset"], **job.get("overrides", {}))

    def build(seed: int) -> nn.Module:
        model = build_model(cfg, dtype=dtype, exact=True, seed=seed)
        # Trained adapters: B non-zero (trained_looking below), so they change every output.
        if job.get("lora"):
            add_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=tuple(job["lora"])), seed=seed)
        return model

    full = build(0)
    trained_looking(full, seed=1)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]

    one = generate(full, prompts)
    split = shard_engine_model(copy.deepcopy(full), tp)
    two = generate(split, prompts)
    two_static = generate(split, prompts, "static")
    control = generate(row_parallel_reference(full, tp), prompts)

    # Weight sync: a shard of another model takes every full weight of `full` through shard_full_weight.
    other = build(5)
    synced = shard_engine_model(other, tp)
    with torch.no_grad():
        for name, p in synced.named_parameters():
            p.copy_(synced.shard_full_weight(name, dict(full.named_parameters())[name]))
    two_synced = generate(synced, prompts)
    stale = generate(shard_engine_model(build(5), tp), prompts)
    lora = {}
    if job.get("lora"):
        lora = {
            "lora_off": compare(
                one, generate(adapters_off(shard_engine_model(copy.deepcopy(full), tp)), prompts)
            )
        }

    # The ranks of the split engine sampled the same tokens and recorded the same logprobs.
    mine = (two[0], [x.tolist() for x in two[1]])
    everyone = [None] * tp.size
    dist.all_gather_object(everyone, mine, group=tp.group)
    assert all(x == mine for x in everyone), "the ranks of the split engine disagree"
    held = sum(p.numel() for p in split.parameters())
    ep = {}
    if job.get("expert_parallel"):
        ep_only = shard_experts(copy.deepcopy(full), tp)
        both = shard_experts(shard_engine_model(copy.deepcopy(full), tp), tp)
        synced_both = shard_experts(shard_engine_model(build(5), tp), tp)
        with torch.no_grad():
            for name, p in synced_both.named_parameters():
                p.copy_(synced_both.shard_full_weight(name, dict(full.named_parameters())[name]))
        ep = {
            # The engine's static decode (every slot on every rank, as its CUDA graphs run it), prefill by count
            "ep2": compare(one, generate(ep_only, prompts, "static")),
            # eager: every call picks the rank's slots by count (prefill's way), none the static way
            "ep2_by_count": compare(one, generate(ep_only, prompts)),
            "tp2_ep2": compare(one, generate(both, prompts, "static")),
            "tp2_ep2_synced": compare(one, generate(synced_both, prompts)),
            "ep_control": compare(one, generate(expert_control(full, tp), prompts)),
            "params_held_ep": sum(p.numel() for p in both.parameters()),
        }
    return (
        ep
        | lora
        | {
            "preset": job["preset"],
            "dtype": job["dtype"],
            "tokens": sum(len(t) for t in one[0]),
            "preemptions": one[2],
            "tp2": compare(one, two),
            "tp2_static": compare(one, two_static),
            "control": compare(one, control),
            "synced": compare(one, two_synced),
            "stale": compare(one, stale),
            "params_full": sum(p.numel() for p in full.parameters()),
            "params_held": held,
            "kv_heads": split.kv_heads,
        }
    )


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo")
    tp = tensor_parallel_groups(dist.get_rank(), dist.get_world_size(), 2)
    results = [run_job(job, tp) for job in spec["jobs"]]
    if dist.get_rank() == 0:
        with open(spec.get("out", "tp.json"), "w") as f:
            json.dump(results, f)
    # Leave the group as a command does (barrier, destroy, a pause with the GIL released): a rank that tears its
    # group down and exits at once can die of SIGABRT at exit after its work is done (docs/benchmarks.md, "World
    # sizes on the CPU"; seen once under a loaded make test, 2026-11-28).
    import exactrl.cli

    exactrl.cli._end_process_group()


if __name__ == "__main__":
    main()
