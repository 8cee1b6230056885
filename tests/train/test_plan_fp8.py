"""The memory plan counts the fp8 copy (`model.precision = "fp8"`): the e4m3 values (K padded to whole 128-blocks),
the fp32 scales (one per row and 128-block) and on the CPU the float64 copy of the values, on every holder. The
figure is checked against the bytes an fp8 model built on the CPU allocates, for a dense and an MoE preset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from exactrl.model.loading import load_policy
from exactrl.train.memory import count_tensors, fp8_copy_bytes, plan_memory
from exactrl.train.memory_generator import plan_generator

sys.path.insert(0, str(Path(__file__).parent))
from test_plan import run_cfg  # noqa: E402  (the tiny bf16 config the plan tests share)


def _allocated(model) -> tuple[int, int]:
    """(bytes of every fp8 copy's values and scales, bytes of the CPU's float64 operands) the model holds."""
    entries = list(model.ops._weights.values())
    assert entries
    copy = sum(e.q.nbytes + e.scale.nbytes for e in entries)
    return copy, sum(e.operand.nbytes for e in entries if e.operand is not e.q)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_plan_counts_the_fp8_copy_a_model_allocates(preset):
    cfg = run_cfg(f"model.preset={preset}", "model.precision=fp8", "run.device=cpu")
    model, _ = load_policy(preset_name=preset, dtype="bfloat16", precision="fp8")
    copy, operands = _allocated(model)
    c = count_tensors(cfg)
    assert fp8_copy_bytes(c, cuda=True) == copy
    assert fp8_copy_bytes(c, cuda=False) == copy + operands
    # One process: the policy's copy, in every phase, and nothing of the kind in the model dtype.
    plan = plan_memory(cfg, device="cpu")
    assert all(p.terms["policy_fp8"] == copy + operands for p in plan.phases)
    plain = plan_memory(run_cfg(f"model.preset={preset}", "run.device=cpu"), device="cpu")
    assert plan.peak - plain.peak == copy + operands
    # Two FSDP2 ranks: the replica's copy, whole; the trainer keeps none, its ops quantize one copy at a time
    # while it trains (tests/distributed/test_fp8_fsdp.py measures that figure).
    two = plan_memory(cfg, world_size=2, device="cuda")
    assert two.phase("generation").terms["engine_replica_fp8"] == copy
    assert not {"policy_fp8", "fsdp_fp8_op_copy"} & set(two.phase("generation").terms)
    assert 0 < two.phase("training").terms["fsdp_fp8_op_copy"] < copy
    # A generator rank: the copy it quantizes from the synced weights.
    gen = plan_generator(
        run_cfg(f"model.preset={preset}", "model.precision=fp8", "distributed.generator_ranks=1"),
        world_size=3,
    )
    assert gen.phase("generation").terms["engine_fp8"] == copy


@pytest.mark.parametrize(("t", "e"), [(2, 1), (1, 2), (2, 2)])
def test_plan_counts_a_split_engines_fp8_copy(t, e):
    """One rank of an engine split by tensor and/or expert parallel holds its rows of each fp8 copy: the plan's
    figure is what the split model (rank 0 of 2, built on the CPU) registers and quantizes."""
    from exactrl.distributed.shared_engine import split_engine_model
    from exactrl.distributed.tensor_parallel import TensorParallelGroup
    from exactrl.model.precision import refresh_fp8, register_fp8

    sets = ["model.preset=tiny-moe", "model.precision=fp8", f"engine.tensor_parallel={t}"]
    cfg = run_cfg(*sets, f"engine.expert_parallel={e}")
    model, _ = load_policy(preset_name="tiny-moe", dtype="bfloat16", precision="fp8")
    shard = split_engine_model(model, TensorParallelGroup(max(t, e), 0), t, e)
    register_fp8(shard)
    refresh_fp8(shard)
    copy, operands = _allocated(shard)
    c = count_tensors(cfg)
    assert fp8_copy_bytes(c, cuda=True, shard=True) == copy
    assert fp8_copy_bytes(c, cuda=False, shard=True) == copy + operands < fp8_copy_bytes(c, cuda=False)
    two = plan_memory(cfg, world_size=2, device="cuda").phase("generation").terms
    assert two["engine_replica_fp8"] == copy


@pytest.mark.parametrize(("t", "e"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_plan_counts_what_an_fp8_generator_holds(t, e):
    """A generator rank holds its fp8 projections as their copies alone (`empty_fp8_only`, as `generator_engine`
    makes its model): the plan's engine weights and fp8 copy are the bytes that model (one rank of an engine split
    by tensor and/or expert parallel, or whole) allocates on the CPU, and a step's sync bucket is the largest
    bucket of what the fp8 sync sends (`fp8_sync_tensors` of an fp8 replica); the warm start's sync (model-dtype
    weights) keeps the model dtype's bucket."""
    from exactrl.distributed.layout import buckets
    from exactrl.distributed.shared_engine import split_engine_model
    from exactrl.distributed.tensor_parallel import TensorParallelGroup
    from exactrl.model.loading import policy_structure
    from exactrl.model.precision import empty_fp8_only, fp8_sync_tensors

    s = max(t, e)
    sets = ["model.preset=tiny-moe", f"engine.tensor_parallel={t}", f"engine.expert_parallel={e}"]
    sets.append(f"distributed.generator_ranks={s}")
    model, _ = policy_structure(preset_name="tiny-moe", dtype="bfloat16")
    if s > 1:
        model = split_engine_model(model, TensorParallelGroup(s, 0), t, e)
    model = empty_fp8_only(model, "cpu", "fp8")
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    copy, _ = _allocated(model)
    sender, _ = load_policy(preset_name="tiny-moe", dtype="bfloat16", precision="fp8")
    named = list(sender.named_parameters())
    sent = [x for _, _, x in fp8_sync_tensors(sender, named)]
    fp8_bucket = max(sum(sent[i].numel() * sent[i].element_size() for i in idx) for idx in buckets(sent))
    plain = [p for _, p in named]
    dtype_bucket = max(sum(plain[i].numel() * 2 for i in idx) for idx in buckets(plain))
    plan = plan_generator(run_cfg(*sets, "model.precision=fp8"), world_size=2 + s)
    bf16 = plan_generator(run_cfg(*sets), world_size=2 + s)
    gen = plan.phase("generation").terms
    assert gen["engine_weights"] == sum(storages.values()) < bf16.phase("generation").terms["engine_weights"]
    assert gen["engine_fp8"] == copy
    assert plan.phase("sync").terms["sync_bucket"] == fp8_bucket < dtype_bucket
    assert plan.phase("first_sync").terms["sync_bucket"] == max(dtype_bucket, fp8_bucket)
