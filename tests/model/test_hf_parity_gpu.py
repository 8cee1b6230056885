"""bf16 on the GPU: exactrl's Triton path against transformers on the same GPU, per family and RoPE scaling.

Two implementations in bf16 round differently (HF casts cos/sin to bf16 and uses its own attention kernels;
exactrl keeps an fp32 RoPE table and its batch-invariant kernels), so this asserts closeness, not equality, and
prints the max |logprob diff| per option."""

import pytest
import torch
from test_hf_parity import _LONG, _hf_model  # the sibling module: same models as the CPU tests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

transformers = pytest.importorskip("transformers")

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
_LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 10000.0,
}
CASES = {
    "qwen3": ("qwen3", True, {}),
    "qwen2-bias": ("qwen2", True, {}),
    "llama-biases": ("llama", False, {"attention_bias": True, "mlp_bias": True}),
    "qwen3-yarn": ("qwen3", True, {"rope_parameters": _YARN}),
    "llama-llama3": ("llama", True, {"rope_parameters": _LLAMA3}),
    "qwen2-linear": ("qwen2", False, {"rope_parameters": {"rope_type": "linear", "factor": 4.0}}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_gpu_close_to_transformers(tmp_path, case):
    from exactrl.model.hf import load_model
    from exactrl.ops import AttentionBatch

    arch, tied, overrides = CASES[case]
    hf = _hf_model(arch, tied, **overrides)
    hf.save_pretrained(tmp_path)
    hf = hf.to("cuda", torch.bfloat16)
    ours = load_model(tmp_path, device="cuda", dtype=torch.bfloat16, exact=True)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in _LONG]
    want = []
    with torch.no_grad():
        for s in seqs:
            ids = s[None].cuda()
            lp = torch.log_softmax(hf(ids).logits[0, :-1].float(), -1)
            want.append(lp.gather(1, ids[0, 1:, None])[:, 0])
        batch = AttentionBatch.packed([len(s) for s in seqs], device="cuda")
        ids = torch.cat(seqs).cuda()
        lp, _ = ours.logprobs(ours(ids, batch.q_pos, batch), torch.roll(ids, -1))
    keep = torch.ones(len(ids), dtype=torch.bool)
    keep[torch.cumsum(torch.tensor([len(s) for s in seqs]), 0) - 1] = False
    diff = (lp[keep.cuda()] - torch.cat(want)).abs()
    print(f"{case}: bf16 GPU max |logprob diff| {diff.max().item():.3e}, mean {diff.mean().item():.3e}")
    assert diff.max().item() < 0.25  # closeness across implementations; a wrong RoPE or bias is off by nats
