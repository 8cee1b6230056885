"""The weight sync in fp8 (a disaggregated run's trainers to its generators, exactrl/train/disagg.py): an fp8
projection goes as its fp8 values and scales, about half the bytes of its bf16 weight, and the receiver's fp8 copies
are bitwise those it would quantize itself from the same weights; its forward reads them, never its model-dtype
projection weights (which the sync no longer fills). Here the broadcast is a copy; the runs over ranks are
tests/distributed/test_disagg.py's (fp8 colocated and disaggregated equal)."""

from __future__ import annotations

import torch

from exactrl.model.loading import load_policy, policy_structure
from exactrl.model.precision import (
    apply_precision,
    fp8_sync_received,
    fp8_sync_targets,
    fp8_sync_tensors,
    refresh_fp8,
)
from exactrl.ops.batch import AttentionBatch


def _logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        h = model(ids, torch.arange(ids.numel()), AttentionBatch.packed([ids.numel()]))
        return model.logprobs(h[:-1], ids[1:])[0]


def test_a_receiver_holds_the_fp8_copy_it_would_quantize_for_half_the_bytes():
    sender, _ = load_policy(preset_name="tiny-moe", dtype="bfloat16", seed=0, precision="fp8")
    named = list(sender.named_parameters())
    sent = fp8_sync_tensors(sender, named)
    receiver, _ = policy_structure(preset_name="tiny-moe", dtype="bfloat16")
    receiver = apply_precision(receiver.to_empty(device="cpu").requires_grad_(False), "fp8", quantize=False)
    params = dict(receiver.named_parameters())
    names, kinds = [n for n, _, _ in sent], [k for _, k, _ in sent]
    for target, (_, _, t) in zip(fp8_sync_targets(receiver, params, names, kinds), sent):
        target.copy_(t)  # what the broadcast does
    fp8_sync_received(receiver, params, names, kinds)
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
