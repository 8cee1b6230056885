"""The weight sync in fp8 (a disaggregated run's trainers to its generators, exactrl/train/disagg.py): an fp8
projection goes as its fp8 values and scales, about half the bytes of its bf16 weight, and the receiver's fp8 copies
are bitwise those it would quantize itself from the same weights. A generator holds those projections as their fp8
copies alone (`empty_fp8_only`: no memory for their model-dtype weights); a sync of model-dtype weights (the first,
after a warm start) is quantized into the copies on arrival, a split engine's rank taking its rows of the whole
weight's copy. Here the broadcast is a copy; the runs over ranks are tests/distributed/test_disagg.py's (fp8
colocated and disaggregated equal)."""

from __future__ import annotations

import pytest
import torch

from exactrl.model.loading import load_policy, policy_structure
from exactrl.model.precision import (
    empty_fp8_only,
    fp8_projections,
    fp8_sync_received,
    fp8_sync_targets,
    fp8_sync_tensors,
    refresh_fp8,
)
from exactrl.ops.batch import AttentionBatch
from exactrl.train.disagg import sync_put


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = model(ids, torch.arange(ids.numel()), AttentionBatch.packed([ids.numel()]))
        return model.logprobs(h[:-1], ids[1:])[0]


def _generator_model(split: tuple[int, int] | None = None):
    """A generator's model as `generator_engine` makes it (tiny-moe, bf16, fp8): its structure, split over two
    ranks where `split` = (tensor_parallel, expert_parallel) says (this one rank 0), given memory."""
    model, _ = policy_structure(preset_name="tiny-moe", dtype="bfloat16")
    if split is not None:
        from exactrl.distributed.shared_engine import split_engine_model
        from exactrl.distributed.tensor_parallel import TensorParallelGroup

        model = split_engine_model(model, TensorParallelGroup(2, 0), *split)
    return empty_fp8_only(model, "cpu", "fp8").requires_grad_(False)


def _receive(receiver, sent: list[tuple[str, str, torch.Tensor]]) -> None:
    """`sent` (`fp8_sync_tensors`) received as a generator receives a sync: each whole tensor put (`sync_put`) as
    `recv_weights` puts it out of its bucket (the broadcast a copy), then `fp8_sync_received`."""
    params = dict(receiver.named_parameters())
    names, kinds = [n for n, _, _ in sent], [k for _, k, _ in sent]
    put = sync_put(receiver, params, names, kinds, fp8_sync_targets(receiver, params, names, kinds))
    for i, (_, _, t) in enumerate(sent):
        put(i, t.detach().clone())
    fp8_sync_received(receiver, params, names, kinds)


def _param_storage_bytes(model) -> int:
    """Bytes of the distinct storages under `model`'s parameters: what its weights allocate."""
    seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(seen.values())


def _copies(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every fp8 copy of `model` by its weight's name: (values as bytes, scales)."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for mod, attr, _ in fp8_projections(model):
        e = model.ops.entry_of(getattr(mod, attr))
        out[names[id(e.param)]] = (e.q.view(torch.uint8), e.scale)
    return out


def test_a_generator_holds_no_model_dtype_weight_of_an_fp8_projection():
    """`empty_fp8_only` (what a generator is made with): the parameters allocate the bytes of every weight but the
    fp8 projections' (those, one element shared by all), on one rank and on a rank of a split engine; a write into
    such a weight fails, and a copy the sync has not sent refuses to be used."""
    for split in (None, (2, 1), (1, 2), (2, 2)):
        model = _generator_model(split)
        fp8 = {id(getattr(mod, attr)) for mod, attr, _ in fp8_projections(model)}
        assert fp8 and len(fp8) == model.ops.num_weights
        rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in fp8)
        assert _param_storage_bytes(model) == rest + 2, split  # the one bf16 element the projections share
        # Their shapes are the weights' (the split's): what the sync's buckets and LoRA read.
        structure, _ = policy_structure(preset_name="tiny-moe", dtype="bfloat16")
        if split is None:
            shapes = {n: p.shape for n, p in structure.named_parameters()}
            assert all(p.shape == shapes[n] for n, p in model.named_parameters())
    w = next(getattr(mod, attr) for mod, attr, _ in fp8_projections(model))
    with pytest.raises(RuntimeError, match="more than one element"):
        w.copy_(torch.zeros(w.shape, dtype=w.dtype))
    with pytest.raises(RuntimeError, match="held as its fp8 copy alone"):
        model.ops.entry_of(w).current()


def test_a_receiver_holds_the_fp8_copy_it_would_quantize_for_half_the_bytes():
    sender, _ = load_policy(preset_name="tiny-moe", dtype="bfloat16", seed=0, precision="fp8")
    named = list(sender.named_parameters())
    sent = fp8_sync_tensors(sender, named)
    receiver = _generator_model()
    names, kinds = [n for n, _, _ in sent], [k for _, k, _ in sent]
    _receive(receiver, sent)
    refresh_fp8(receiver)  # as the generator does after a sync: nothing left to quantize
    # What it would quantize itself: a model of the sender's weights.
    own, _ = load_policy(preset_name="tiny-moe", dtype="bfloat16", seed=1, precision="fp8")
    own.load_state_dict(sender.state_dict())
    mine, theirs = dict(receiver.named_parameters()), dict(own.named_parameters())
    fp8 = [n for n, k in zip(names, kinds) if k == "fp8_values"]
    assert len(fp8) == receiver.ops.num_weights == own.ops.num_weights
    for n in fp8:
        a, b = receiver.ops._entry(mine[n]), own.ops._entry(theirs[n])
        assert torch.equal(a.q.view(torch.uint8), b.q.view(torch.uint8)) and torch.equal(a.scale, b.scale), n
    ids = torch.arange(40) % receiver.config.vocab_size
    assert torch.equal(_logprobs(receiver, ids), _logprobs(own, ids))
    # The projections' bytes on the wire: 1 + 4 / 128 per element where K is whole 128-blocks (tiny-moe's experts'
    # down_proj has K = 64, padded to 128) against bf16's 2.
    weights = dict(named)
    whole = {n for n in fp8 if weights[n].shape[-1] % 128 == 0}
    assert whole and len(whole) < len(fp8)
    fp8_bytes = sum(t.numel() * t.element_size() for n, k, t in sent if k != "weight" and n in whole)
    bf16_bytes = sum(weights[n].numel() * weights[n].element_size() for n in whole)
    assert fp8_bytes / bf16_bytes == (1 + 4 / 128) / 2


@pytest.mark.parametrize("split", [None, (2, 1), (1, 2), (2, 2)], ids=["one", "tp", "ep", "tp-ep"])
def test_a_model_dtype_sync_into_a_generator_gives_the_copies_of_the_fp8_sync(split):
    """The first sync after a warm start sends model-dtype weights (the sender's have no fp8 copy): a generator that
    holds its projections as their fp8 copies alone quantizes each on arrival, and holds bitwise the copies the fp8
    sync gives it (the sender's, whole, or a split rank's rows of them). The negative control: a tensor-parallel
    rank quantizing its slice of a weight alone (tiny-moe's 64 query rows a rank cut a 128-row block) differs."""
    sender, _ = load_policy(preset_name="tiny-moe", dtype="bfloat16", seed=0, precision="fp8")
    named = list(sender.named_parameters())
    by_weight, by_fp8 = _generator_model(split), _generator_model(split)
    _receive(by_weight, fp8_sync_tensors(None, named))  # every tensor as its model-dtype weight
    _receive(by_fp8, fp8_sync_tensors(sender, named))
    a, b = _copies(by_weight), _copies(by_fp8)
    assert a.keys() == b.keys() and len(a) == by_fp8.ops.num_weights
    for n in a:
        assert torch.equal(a[n][0], b[n][0]) and torch.equal(a[n][1], b[n][1]), n
    plain = {n: p for n, p in by_weight.named_parameters() if n not in a}
    assert all(torch.equal(p, dict(by_fp8.named_parameters())[n]) for n, p in plain.items())
    assert _param_storage_bytes(by_weight) == _param_storage_bytes(by_fp8)  # nothing model-dtype kept
    if split is None:
        ids = torch.arange(40) % by_weight.config.vocab_size
        assert torch.equal(_logprobs(by_weight, ids), _logprobs(sender, ids))
    if split is not None and split[0] == 2:
        from exactrl.ops.fp8 import quantize_weight

        weights = dict(named)
        alone = {
            n: quantize_weight(by_weight.shard_full_weight(n, weights[n]), by_weight.ops.entry_of(p).parts)
            for n, p in by_weight.named_parameters()
            if n.endswith("qkv_proj.weight")
        }
        assert alone and any(not torch.equal(q.view(torch.uint8), a[n][0]) for n, (q, _) in alone.items())
