"""The memory plan counts the fp8 copy (`model.precision = "fp8"`): the e4m3 values (K padded to whole 128-blocks),
the fp32 scales (one per row and 128-block) and on the CPU the float64 copy of the values, on every holder (an FSDP2
trainer's: kept whole, or one op's with train.fsdp_fp8_copies = "per_use"). The figure is checked against the bytes
an fp8 model built on the CPU allocates, for a dense and an MoE preset."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from exactrl.model.loading import load_policy
from exactrl.train.memory import CUDA_CONTEXT_BYTES, _gib, count_tensors, fp8_copy_bytes, plan_memory
from exactrl.train.memory_fit import make_plan
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
    sets = [f"model.preset={preset}", "model.precision=fp8", "run.device=cpu"]
    cfg = run_cfg(*sets)
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
    # Two FSDP2 ranks (tests/distributed/test_fp8_fsdp.py measures what each mode holds): the replica's copy, whole;
    # the trainer's copies of its gathered weights kept (train.fsdp_fp8_copies = "kept", the default), whole, in
    # every phase; or quantized per use: one op's copy at a time while it trains.
    two = plan_memory(cfg, world_size=2, device="cuda")
    held = [p for p in two.phases if p.name != "setup"]  # (the set-up holds the whole models' copies)
    assert held and all(p.terms["engine_replica_fp8"] == p.terms["policy_fp8"] == copy for p in held)
    assert not any("fsdp_fp8_op_copy" in p.terms for p in two.phases)
    per_use = plan_memory(
        run_cfg(*sets, "train.fsdp_fp8_copies=per_use"), world_size=2, device="cuda"
    )  # fmt: skip
    assert per_use.phase("generation").terms["engine_replica_fp8"] == copy
    assert not {"policy_fp8", "fsdp_fp8_op_copy"} & set(per_use.phase("generation").terms)
    assert 0 < per_use.phase("training").terms["fsdp_fp8_op_copy"] < copy
    assert "policy_fp8" not in per_use.phase("training").terms
    # One process: no FSDP2, so the key changes nothing.
    assert plan_memory(run_cfg(*sets, "train.fsdp_fp8_copies=per_use"), device="cpu").phases == plan.phases
    # A generator rank: the copy it quantizes from the synced weights.
    gen = plan_generator(
        run_cfg(f"model.preset={preset}", "model.precision=fp8", "distributed.generator_ranks=1"),
        world_size=3,
    )
    assert gen.phase("generation").terms["engine_fp8"] == copy


def test_a_refused_fsdp2_plan_names_the_per_use_copies_with_their_trade():
    """FSDP2 ranks whose kept fp8 copies tip the plan over the device: the refusal names train.fsdp_fp8_copies =
    "per_use", what it saves a rank and what it costs; not where the copies are already per use, nor on one
    device (the key does nothing there)."""
    sets = ["model.preset=qwen3-1.7b", "model.precision=fp8", "model.dtype=bfloat16"]
    kept = plan_memory(run_cfg(*sets), world_size=2, device="cuda")
    per_use = plan_memory(run_cfg(*sets, "train.fsdp_fp8_copies=per_use"), world_size=2, device="cuda")
    assert per_use.peak < kept.peak
    gpu = CUDA_CONTEXT_BYTES + (kept.peak + per_use.peak) // 2  # per use fits, kept does not
    plan = make_plan(run_cfg(*sets), world_size=2, gpu_memory=gpu, device="cuda")
    assert not plan.fits
    less = _gib(kept.peak - per_use.peak)
    wanted = (
        f'train.fsdp_fp8_copies="per_use" to quantize per use: ~{less} GiB less a rank, one quantization of each '
        f"weight per forward (peak {_gib(per_use.peak)} GiB)"
    )
    assert wanted in plan.suggestions and wanted in plan.refusal(), plan.suggestions
    assert make_plan(run_cfg(*sets, "train.fsdp_fp8_copies=per_use"), world_size=2, gpu_memory=gpu).fits
    one = make_plan(run_cfg(*sets), gpu_memory=gpu, device="cuda")
    assert not one.fits and not any("fsdp_fp8_copies" in s for s in one.suggestions)


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
