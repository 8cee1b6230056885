"""fp8 projections under FSDP2 (one gloo rank in this process, no torchrun): the trainer quantizes its gathered
weights, the engine replica quantizes the weights the sync wrote, and after every optimizer step both give bitwise
equal logprobs, equal to a one-process fp8 model holding the same weights.

The trainer's copies (`train.fsdp_fp8_copies`): "kept" (the default) keeps each copy from one step to the next,
quantized once a step (the step marks it stale), and holds what the memory plan's `policy_fp8` says; "per_use"
keeps none: each op quantizes its gathered weight for itself and drops the copy when it returns
(`Fp8Weight.current`), so between forwards none is alive (storages followed by weak references) and during one at
most one op's, the plan's `fsdp_fp8_op_copy`; activation checkpointing's recomputation quantizes the same bits again
(the same gradients). Both modes give the same logprobs and gradients, bit for bit. Negative controls: a kept-mode
step that does not mark the copies stale leaves the trainer's logprobs differing from the replica's; a per-use
trainer that keeps its first copies does too, and holds them between forwards; a GEMM handed a per-use entry's own
(empty) buffers fails loudly. (The multi-rank runs, colocated and with generator ranks:
tests/distributed/test_disagg.py.)"""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from exactrl.config import config_from_dict
from exactrl.distributed.parallelize import Parallelism, apply_activation_checkpointing
from exactrl.model.loading import load_policy
from exactrl.model.precision import apply_precision
from exactrl.ops import set_exact_environment
from exactrl.ops.fp8 import Fp8Ops, Fp8Weight, fp8_linear
from exactrl.train.memory import plan_memory
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import PackedBatch, response_logprobs


def _batch(device) -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (9, 14, 6)]
    return PackedBatch.build(seqs, [4, 5, 3], device)


def _logprobs(model, pb: PackedBatch) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(model, pb, 1.0)[0]


def _held(model) -> int:
    """Bytes of the fp8 copies `model`'s entries hold (values, scales and the CPU's float64 values)."""
    es = model.ops.entries()
    return sum(e.q.nbytes + e.scale.nbytes + (e.operand.nbytes if e.operand is not e.q else 0) for e in es)


class _Copies:
    """The fp8 copies an FSDP2 model's ops quantize for themselves (`Fp8Weight.current` of a per-use entry), each
    storage followed by a weak reference: the bytes alive now, the most alive at once, and how many were made."""

    def __init__(self, monkeypatch):
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}  # data_ptr -> (weak reference, bytes)
        self.peak = self.made = 0
        inner = Fp8Weight.current

        def current(entry: Fp8Weight) -> Fp8Weight:
            out = inner(entry)
            if entry.per_use:
                self.made += 1
                for t in (out.q, out.scale, out.operand):
                    st = t.untyped_storage()
                    self.storages[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
                self.peak = max(self.peak, self.alive())
            return out

        monkeypatch.setattr(Fp8Weight, "current", current)

    def alive(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())


def _run(
    ctx,
    steps: int,
    *,
    mode: str = "per_use",
    preset: str = "tiny",
    checkpointing: bool = False,
    copies: _Copies | None = None,
):
    """Per step (after it): the trainer's, the replica's, a one-process fp8 model's (the replica's weights) and a
    one-process bf16 model's logprobs, and the step's gradients (name -> tensor). mode: train.fsdp_fp8_copies.
    copies (per_use): checks that no fp8 copy of the trainer is alive after its forward (the autograd graph alive),
    its backward and the step. Returns (those per step, the trainer, the replica)."""
    set_exact_environment(True)
    model, _ = load_policy(preset_name=preset, dtype="bfloat16", seed=0, precision="fp8")
    par = Parallelism(ctx, fp8_copies=mode)
    replica = par.engine_model(model)
    par.parallelize(model)
    if checkpointing:
        apply_activation_checkpointing(model)
    par.bind(model, replica)
    layers = model.config.num_layers
    # qkv, o and gate_up and down (a dense MLP) or the experts' two stacks
    assert isinstance(replica.ops, Fp8Ops) and replica.ops.num_weights == 4 * layers
    opt = MasterAdamW(model, lr=1e-2, dist=ctx)
    pb = _batch(model.device)
    out = []
    for _ in range(steps):
        lp, _, _ = response_logprobs(model, pb, 1.0)
        assert copies is None or copies.alive() == 0  # the graph for the backward keeps no copy
        (-lp.float().mean()).backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.clip_and_step(1.0)
        par.sync_weights()
        assert copies is None or copies.alive() == 0
        alone, _ = load_policy(preset_name=preset, dtype="bfloat16", seed=0)
        alone.load_state_dict(replica.state_dict())
        bf16 = _logprobs(alone, pb)
        fp8 = _logprobs(apply_precision(alone, "fp8"), pb)
        out.append((_logprobs(model, pb), _logprobs(replica, pb), fp8, bf16, grads))
    return out, model, replica


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_fsdp_trainer_and_replica_quantize_the_same_weights(one_gloo_rank, monkeypatch, preset):
    copies = _Copies(monkeypatch)
    steps, model, replica = _run(one_gloo_rank, 2, preset=preset, copies=copies)
    for trainer, rep, alone, bf16, _ in steps:
        assert torch.equal(trainer, rep) and torch.equal(rep, alone)
        assert not torch.equal(rep, bf16)  # fp8 is on (the replica does not fall back to the model dtype)
    # Each fp8 weight (4 a layer) was quantized anew for each of the trainer's forwards (2 a step), and kept nowhere.
    assert copies.made == 2 * 2 * 4 * model.config.num_layers
    # One entry a weight (FSDP2 refills one gathered tensor), none holding a copy.
    assert len(model.ops.entries()) == 4 * model.config.num_layers
    assert all(e.per_use for e in model.ops.entries()) and _held(model) == 0
    # The memory plan's figures (an FSDP2 plan on the CPU): the replica's copy, kept in every phase; the trainer's
    # copy of one op (the experts' op: both stacks), in the training phase only.
    cfg = config_from_dict(
        {
            "model": {"preset": preset, "dtype": "bfloat16", "precision": "fp8"},
            "train": {"fsdp_fp8_copies": "per_use"},
        }
    )
    plan = plan_memory(cfg, world_size=1, device="cpu", sharded=True)
    gen, train = plan.phase("generation").terms, plan.phase("training").terms
    assert _held(replica) == gen["engine_replica_fp8"] and "fsdp_fp8_op_copy" not in gen
    assert copies.peak == train["fsdp_fp8_op_copy"] and "policy_fp8" not in train


class _Quantizations:
    """How many times each registered entry of a model quantized itself (`Fp8Weight.quantize`), by id. Every entry
    counted is held here, so that no id is reused: an entry freed in the run (the one-process models' of each step,
    an entry replaced while the trainer is set up) would otherwise hand its count to a later entry at its address."""

    def __init__(self, monkeypatch):
        self.by_entry: dict[int, tuple[Fp8Weight, int]] = {}
        inner = Fp8Weight.quantize

        def quantize(entry: Fp8Weight, source=None) -> None:
            self.by_entry[id(entry)] = (entry, self.by_entry.get(id(entry), (entry, 0))[1] + 1)
            inner(entry, source)

        monkeypatch.setattr(Fp8Weight, "quantize", quantize)

    def of(self, model) -> list[int]:
        return [self.by_entry.get(id(e), (e, 0))[1] for e in model.ops.entries()]


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_kept_copies_give_the_per_use_bits_and_hold_the_plans_bytes(one_gloo_rank, monkeypatch, preset):
    """train.fsdp_fp8_copies = "kept" (the default): the trainer's logprobs and gradients equal the per-use
    trainer's, bit for bit, and the replica's; each copy is quantized once a step (at the first forward after the
    step marked it stale: the forward before the step's and the scoring after it share one), and the trainer holds
    the whole model's copies, the plan's `policy_fp8`."""
    per_use, _, _ = _run(one_gloo_rank, 2, preset=preset)
    counts = _Quantizations(monkeypatch)
    kept, model, replica = _run(one_gloo_rank, 2, mode="kept", preset=preset)
    for (t0, _, _, _, g0), (t1, r1, a1, bf16, g1) in zip(per_use, kept):
        assert g0.keys() == g1.keys() and all(torch.equal(g0[n], g1[n]) for n in g0)
        assert torch.equal(t1, t0) and torch.equal(t1, r1) and torch.equal(r1, a1)
        assert not torch.equal(r1, bf16)
    # 4 fp8 weights a layer, one entry each, none per use; quantized at the first forward and once after each step.
    assert len(model.ops.entries()) == 4 * model.config.num_layers
    assert not any(e.per_use for e in model.ops.entries())
    assert counts.of(model) == [1 + 2] * len(model.ops.entries())
    cfg = config_from_dict({"model": {"preset": preset, "dtype": "bfloat16", "precision": "fp8"}})
    plan = plan_memory(cfg, world_size=1, device="cpu", sharded=True)
    gen, train = plan.phase("generation").terms, plan.phase("training").terms
    assert (
        _held(model) == gen["policy_fp8"] == train["policy_fp8"]
        and _held(replica) == gen["engine_replica_fp8"]
    )
    assert "fsdp_fp8_op_copy" not in train


def test_a_step_that_leaves_the_kept_copies_stale_differs(one_gloo_rank, monkeypatch):
    """The kept mode's negative control: the step's re-quantization (marking the gathered weights' copies stale)
    planted out, the trainer computes with its first copies and its logprobs differ from the replica's."""
    from exactrl.train import optim

    monkeypatch.setattr(optim, "requantize_after_step", lambda *a, **k: None)
    ((trainer, replica, alone, _, _),), _, _ = _run(one_gloo_rank, 1, mode="kept")
    assert torch.equal(replica, alone) and not torch.equal(trainer, replica)


def _kept_trainer(ctx):
    """An fp8 FSDP2 trainer with kept copies, its replica bound: (model, replica, optimizer, tokenizer)."""
    set_exact_environment(True)
    model, tok = load_policy(preset_name="tiny", dtype="bfloat16", seed=0, precision="fp8")
    par = Parallelism(ctx, fp8_copies="kept")
    replica = par.engine_model(model)
    par.parallelize(model)
    par.bind(model, replica)
    return model, replica, MasterAdamW(model, lr=1e-2, dist=ctx), tok


@pytest.mark.parametrize("planted", [False, True])
def test_a_sharded_load_re_quantizes_the_kept_copies(one_gloo_rank, tmp_path, monkeypatch, planted):
    """Kept mode: a sharded checkpoint's load writes the shards in place, which no version counter records, so it
    marks every kept copy stale (`fp8_weights_changed`): a trainer whose copies were quantized from its first
    weights, loaded with a trained trainer's checkpoint, gives that trainer's logprobs. planted: the marking taken
    out (the negative control): it computes with its first copies, and its logprobs differ."""
    from exactrl.train import sharded_checkpoint as ckpt

    pb = _batch(torch.device("cpu"))
    trained, replica, opt, tok = _kept_trainer(one_gloo_rank)
    lp, _, _ = response_logprobs(trained, pb, 1.0)
    (-lp.float().mean()).backward()
    opt.clip_and_step(1.0)
    want = _logprobs(trained, pb)
    trained.reshard()  # (FSDP2 leaves the root's parameters gathered after a forward; DCP takes the shards)
    path = ckpt.save_sharded_checkpoint(
        one_gloo_rank, tmp_path, 1, model=trained, engine_model=replica, tokenizer=tok,
        optimizers={"policy": opt}, state={},
    )  # fmt: skip
    fresh, _, opt2, _ = _kept_trainer(one_gloo_rank)
    before = _logprobs(fresh, pb)  # its copies, quantized from the first weights
    fresh.reshard()
    assert not torch.equal(before, want)
    if planted:
        monkeypatch.setattr(ckpt, "fp8_weights_changed", lambda model: None)
    ckpt.load_sharded_checkpoint(path, model=fresh, optimizers={"policy": opt2})
    after = _logprobs(fresh, pb)
    # (Planted, the model-dtype weights outside the projections are the loaded ones, the fp8 copies the old.)
    assert torch.equal(after, want) is not planted


def test_activation_checkpointing_quantizes_the_same_bits_again(one_gloo_rank, monkeypatch):
    """The forward recomputed in the backward quantizes the re-gathered weights again, to the same copies: the
    gradients equal those without checkpointing, and the logprobs stay exact."""
    plain, _, _ = _run(one_gloo_rank, 2)
    copies = _Copies(monkeypatch)
    ac, model, _ = _run(one_gloo_rank, 2, checkpointing=True, copies=copies)
    for (t0, _, _, _, g0), (t1, r1, a1, _, g1) in zip(plain, ac):
        assert g0.keys() == g1.keys() and any(g.abs().sum() > 0 for g in g0.values())
        assert all(torch.equal(g0[n], g1[n]) for n in g0)
        assert torch.equal(t1, r1) and torch.equal(r1, a1) and torch.equal(t1, t0)
    # It recomputed: every layer's forward ran again in the backward, each fp8 weight quantized 3 times a step.
    assert copies.made == 2 * 3 * 4 * model.config.num_layers


def test_a_trainer_that_keeps_its_first_copies_differs(one_gloo_rank, monkeypatch):
    """The negative control of both checks above: copies kept from the trainer's first forward (what a step that
    re-quantizes nothing leaves) give logprobs that differ from the replica's after a step, and stay alive."""
    inner = Fp8Weight.current
    kept: dict[int, Fp8Weight] = {}

    def keep_first(entry: Fp8Weight) -> Fp8Weight:
        if not entry.per_use:
            return inner(entry)
        if id(entry) not in kept:
            kept[id(entry)] = inner(entry)
        return kept[id(entry)]

    monkeypatch.setattr(Fp8Weight, "current", keep_first)
    copies = _Copies(monkeypatch)
    ((trainer, replica, alone, _, _),), _, _ = _run(one_gloo_rank, 1)
    assert torch.equal(replica, alone) and not torch.equal(trainer, replica)
    assert copies.alive() > 0


def test_a_gemm_handed_an_entrys_own_buffers_fails_loudly(one_gloo_rank, monkeypatch):
    """A per-use entry holds no copy (empty buffers): an op that read them instead of a copy made for it (planted
    here) stops with an error that says so, rather than compute with garbage; nor is it quantized in place."""
    inner = Fp8Weight.current
    monkeypatch.setattr(Fp8Weight, "current", lambda e: e if e.per_use else inner(e))
    with pytest.raises(RuntimeError, match="fp8 copy is empty"):
        _run(one_gloo_rank, 1)
    entry = Fp8Weight(torch.ones(8, 16, dtype=torch.bfloat16), None, per_use=True)
    with pytest.raises(RuntimeError, match="holds no copy"):
        entry.quantize()
    x = torch.ones(3, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fp8 copy is empty"):
        fp8_linear(x, entry.param, None, entry.operand, entry.scale)


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__, "-q"])


@pytest.mark.parametrize("mode", ["kept", "per_use"])
def test_parity_trains_with_the_copies_it_is_asked_for(one_gloo_rank, mode):
    """`exactrl parity --fsdp-fp8-copies` reaches its FSDP2 trainer (`sharded_parity_models`): after a forward its
    entries are per use or keep their copies, and its logprobs equal the replica's either way."""
    from exactrl.parity import sharded_parity_models

    set_exact_environment(True)
    model, _ = load_policy(preset_name="tiny", dtype="bfloat16", seed=0, precision="fp8")
    engine, trainer = sharded_parity_models(model, one_gloo_rank, fp8_copies=mode)
    pb = _batch("cpu")
    assert torch.equal(_logprobs(trainer, pb), _logprobs(engine, pb))
    entries = trainer.ops.entries()
    assert entries and all(e.per_use == (mode == "per_use") for e in entries)
