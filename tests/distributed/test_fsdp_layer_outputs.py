"""A decoder layer sharded by FSDP2 returns no view: torch warns ("returned a view tensor ... can cause backward to
fail or produce wrong gradients") for every microbatch whose token count is not a multiple of the exact CPU
backend's row padding (ROW_MULTIPLE), where `F.linear(padded)[:m]` was the MLP's down projection, the layer's
output. One rank of gloo in this process is enough: the warning is FSDP2's hook on the layer's output."""

from __future__ import annotations

import warnings

import torch

from exactrl.distributed.parallelize import Parallelism
from exactrl.model import build_model, preset
from exactrl.ops.batch import AttentionBatch
from exactrl.ops.torch_ops import ROW_MULTIPLE, ExactTorchOps


def test_a_padded_linear_returns_its_own_tensor_with_the_same_bits():
    ops, g = ExactTorchOps(), torch.Generator().manual_seed(0)
    x, w = torch.randn(ROW_MULTIPLE + 3, 24, generator=g), torch.randn(40, 24, generator=g)
    out = ops.linear(x, w)
    assert out._base is None and out.shape == (ROW_MULTIPLE + 3, 40)
    # The first rows are the rows of a larger call (the padding keeps them batch-invariant).
    assert torch.equal(out[:5], ops.linear(torch.cat([x[:5], torch.zeros(30, 24)]), w)[:5])


def test_fsdp2_layers_give_no_view_warning(one_gloo_rank):
    torch.manual_seed(0)
    model = build_model(preset("tiny"), dtype=torch.float32, exact=True, seed=0)
    Parallelism(one_gloo_rank).parallelize(model)
    lens = [3, 4]  # 7 tokens: padded to ROW_MULTIPLE in every linear
    ids = torch.randint(0, model.config.vocab_size, (sum(lens),))
    positions = torch.cat([torch.arange(n) for n in lens])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        hidden = model(ids, positions, AttentionBatch.packed(lens))
        hidden.float().square().sum().backward()
    views = [str(w.message) for w in seen if "returned a view tensor" in str(w.message)]
    assert not views, views[0]
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
