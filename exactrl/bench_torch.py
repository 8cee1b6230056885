"""The stock-PyTorch training step that `exactrl bench train --vs torch` measures exactrl's step against.

`TorchDecoder.from_model` builds, from a loaded dense `CausalLM` (Qwen2, Qwen3, Llama), the decoder a skilled
PyTorch user would write for the same shape, with a copy of the same weights in the model's dtype:

- `nn.Linear` projections (cuBLAS on CUDA); q/k/v stacked into one weight and gate/up into another, as exactrl and
  most fast implementations stack them (one matmul each instead of three and two);
- RMSNorm (HF's order: normalise in fp32, cast, multiply by the weight) and RoPE (the model's own fp32 cos/sin
  table, every rope type included) written in torch ops, for torch.compile to fuse; Qwen3's per-head q/k norm;
- `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on [B, H, L, D]: every sequence of the
  benchmark has the same length, so the batch is a plain [B, L] tensor and PyTorch's flash kernel (FlashAttention-2)
  runs the forward and the backward (no packing, no padding); on CUDA SDPA is restricted to it
  (`attention_backends`), so a shape it cannot serve fails instead of falling back to a slower kernel;
- SiLU-gated MLP, final norm, LM head (tied or not);
- each decoder block compiled on its own (`nn.Module.compile`, as torchtitan does: dynamo traces the block's code
  once and every identical block reuses the graph), and the final norm, LM head and GRPO loss as one compiled
  function (inductor fuses the fp32 upcast, log-softmax, gather and the loss into the head's epilogue passes).

`TorchGrpoStep` is the step: GRPO's clipped token-level policy loss over the completion tokens with fixed
advantages (logprobs by fp32 log-softmax + gather, token-mean; the token entropy as a detached metric, as
exactrl's trainer computes it), backward, then exactrl's optimizer algorithm with stock parts: fp32 master copies
of the 16-bit weights, the gradients cast onto them in one `torch._foreach_copy_`, `clip_grad_norm_(foreach=True)`
at 1.0, `torch.optim.AdamW(fused=True)` on the masters, the masters copied back into the 16-bit weights.

What it does not do, on purpose: CUDA graphs (torch.compile's default mode, as most users run it), activation
checkpointing, batch-invariant kernels or the exactness check, host-side batch preparation in the timed step
(the batch is built once), skipping a step on a non-finite gradient norm. It runs with PyTorch's default numerics
switches (`stock_numerics`), not exact mode's. MoE and LoRA models are refused: the baseline is the dense
full-fine-tune step.

torch.compile needs a C++ compiler (the CPU backend compiles C++; Triton builds its launcher with a C compiler)
and, on CUDA, Triton: `check_compile_available` fails with a message naming what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from exactrl.model.config import ModelConfig
from exactrl.model.qwen import CausalLM
from exactrl.ops.torch_ops import rms_norm_torch  # HF's order, in plain torch ops (compile fuses it)


@dataclass
class GrpoBatch:
    """One microbatch of equal-length sequences (B sequences of L + 1 tokens, the first token the prompt).

    input_ids, targets: [B, L] int64 (targets are input_ids shifted by one); old_logprobs: [B, L] fp32 (the
    sampling policy's); advantages: [B] fp32 (one per sequence, GRPO's); loss_mask: [B, L] bool (completion tokens).
    """

    input_ids: torch.Tensor
    targets: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor

    @staticmethod
    def from_sequences(
        seqs: list[list[int]],
        old_logprobs: torch.Tensor,
        advantages: list[float],
        prompt_len: int,
        device: torch.device | str,
    ) -> GrpoBatch:
        """seqs: B token lists of one length L + 1; old_logprobs: [B, L + 1 - prompt_len] (the completion's)."""
        if len({len(s) for s in seqs}) != 1:
            raise ValueError("the torch baseline batches sequences of one length; got several lengths")
        ids = torch.tensor(seqs, dtype=torch.int64, device=device)
        B, L = ids.shape[0], ids.shape[1] - 1
        if not 1 <= prompt_len <= L or tuple(old_logprobs.shape) != (B, L + 1 - prompt_len):
            raise ValueError(
                f"GrpoBatch: {B} sequences of {L + 1} tokens with a {prompt_len}-token prompt need old_logprobs "
                f"of shape {(B, L + 1 - prompt_len)}, got {tuple(old_logprobs.shape)}"
            )
        old = torch.zeros(B, L, dtype=torch.float32, device=device)
        old[:, prompt_len - 1 :] = old_logprobs.to(device=device, dtype=torch.float32)
        mask = torch.zeros(B, L, dtype=torch.bool, device=device)
        mask[:, prompt_len - 1 :] = (
            True  # target j is token j + 1: a completion token iff j + 1 >= prompt_len
        )
        adv = torch.tensor(advantages, dtype=torch.float32, device=device)
        return GrpoBatch(ids[:, :-1], ids[:, 1:], old, adv, mask)

    @staticmethod
    def from_rollouts(rollouts: list, device: torch.device | str) -> GrpoBatch:
        """The batch of exactrl `Rollout`s of one length and one prompt length (the benchmarks' synthetic ones)."""
        return GrpoBatch.from_sequences(
            [r.prompt_ids + r.completion_ids for r in rollouts],
            torch.stack([r.rollout_logprobs for r in rollouts]),
            [r.advantage for r in rollouts],
            prompt_len=len(rollouts[0].prompt_ids),
            device=device,
        )


# -- the numerics, in plain torch ops (torch.compile fuses each chain into one kernel) --------------------------
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, L, H, Dh]; cos, sin: [L, Dh / 2] fp32 -> x rotated (half-split layout, HF's), in x.dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def grpo_head_loss(
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Final norm, LM head and GRPO's clipped policy loss (token-mean over loss_mask).

    hidden: [B, L, D] -> (loss: 0-d fp32, logprobs: [B, L] fp32 detached, entropy: 0-d fp32 detached, the masked
    token mean). The logits are the model dtype's matmul output, upcast to fp32 before the log-softmax (as
    exactrl's logprob op does without fp32_lm_head)."""
    x = rms_norm_torch(hidden, norm_weight, eps)
    logits = F.linear(x, head_weight).float()  # [B, L, V]
    logp = torch.log_softmax(logits, dim=-1)
    logprobs = logp.gather(-1, targets[..., None]).squeeze(-1)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-20.0, 20.0))  # as exactrl's loss: no overflow to inf
    adv = advantages[:, None]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    m = loss_mask.to(per_token.dtype)
    n = m.sum().clamp(min=1.0)
    loss = (per_token * m).sum() / n
    with torch.no_grad():
        entropy = (-(logp.exp() * logp).sum(-1) * m).sum() / n
    return loss, logprobs.detach(), entropy


# -- the decoder -------------------------------------------------------------------------------------------------
class TorchAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = [q, kv, kv]
        self.qkv_proj = nn.Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim))
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim))
        self.eps = cfg.rms_norm_eps

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(B, L, self.num_heads, self.head_dim)
        k = k.view(B, L, self.num_kv_heads, self.head_dim)
        v = v.view(B, L, self.num_kv_heads, self.head_dim)
        if self.qk_norm:  # Qwen3: RMSNorm over each head before RoPE
            q = rms_norm_torch(q, self.q_norm, self.eps)
            k = rms_norm_torch(k, self.k_norm, self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # [B, H, L, D] for SDPA; GQA's shared K/V heads are expanded inside the kernel, not copied.
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))


class TorchMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TorchBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.self_attn = TorchAttention(cfg)
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp = TorchMLP(cfg)
        self.eps = cfg.rms_norm_eps

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(rms_norm_torch(h, self.input_layernorm, self.eps), cos, sin)
        return h + self.mlp(rms_norm_torch(h, self.post_attention_layernorm, self.eps))


class TorchDecoder(nn.Module):
    """The plain-PyTorch decoder of a dense `ModelConfig` (see the module docstring). Build it with `from_model`
    (a copy of a `CausalLM`'s weights), then `compile_blocks()` it for the benchmark."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.is_moe:
            raise ValueError(
                f"the torch baseline is a dense decoder; {cfg.architecture} is a mixture of experts "
                "(bench train --vs torch covers dense models)"
            )
        cfg.validate()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TorchBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # The model's own fp32 cos|sin table (every rope type's frequencies and YaRN's attention factor in it).
        self.register_buffer("cos_sin", cfg.rope_table(), persistent=False)
        self._head_loss = grpo_head_loss  # compile_blocks() replaces it by its compiled self

    @staticmethod
    @torch.no_grad()
    def from_model(model: CausalLM, config: ModelConfig | None = None) -> TorchDecoder:
        """A copy of `model`'s weights (not shared: the baseline's optimizer steps leave `model` alone) in its dtype,
        on its device. `config` replaces the model's config (the tests plant a wrong one this way)."""
        if model.lora_spec is not None:
            raise ValueError("the torch baseline trains every weight; this model has LoRA adapters")
        cfg = config or model.config
        with torch.device("meta"):
            out = TorchDecoder(cfg)
        out = out.to_empty(device=model.device).to(model.dtype)
        out.cos_sin = cfg.rope_table().to(model.device)  # to_empty left the buffer uninitialised; fp32
        src = model.model
        out.embed_tokens.weight.copy_(src.embed_tokens.weight)
        out.norm.copy_(src.norm.weight)
        if out.lm_head is not None:
            out.lm_head.weight.copy_(model.lm_head_weight())
        for mine, theirs in zip(out.layers, src.layers, strict=True):
            mine.input_layernorm.copy_(theirs.input_layernorm.weight)
            mine.post_attention_layernorm.copy_(theirs.post_attention_layernorm.weight)
            a, b = mine.self_attn, theirs.self_attn
            _copy_linear(a.qkv_proj, b.qkv_proj)
            _copy_linear(a.o_proj, b.o_proj)
            if a.qk_norm:
                if b.q_norm is None:  # a planted config with q/k norm the model does not have: ones (no-op)
                    a.q_norm.fill_(1.0)
                    a.k_norm.fill_(1.0)
                else:
                    a.q_norm.copy_(b.q_norm.weight)
                    a.k_norm.copy_(b.k_norm.weight)
            _copy_linear(mine.mlp.gate_up_proj, theirs.mlp.gate_up_proj)
            _copy_linear(mine.mlp.down_proj, theirs.mlp.down_proj)
        return out

    def compile_blocks(self) -> TorchDecoder:
        """Compile each block (in place; one dynamo trace serves every identical block) and the head + loss, with
        torch.compile's default mode (no CUDA graphs). Returns self."""
        check_compile_available(self.embed_tokens.weight.device)
        for block in self.layers:
            block.compile(dynamic=False)
        self._head_loss = torch.compile(grpo_head_loss, dynamic=False)
        return self

    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, L] int64 (each row a sequence from position 0) -> hidden states [B, L, D] before the
        final norm."""
        L = input_ids.shape[1]
        half = self.config.head_dim // 2
        cs = self.cos_sin[:L]
        cos, sin = cs[:, :half], cs[:, half:]
        h = self.embed_tokens(input_ids)
        for block in self.layers:
            h = block(h, cos, sin)
        return h

    def loss(
        self, batch: GrpoBatch, eps_low: float = 0.2, eps_high: float = 0.2
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(GRPO loss, logprobs [B, L] fp32, token-mean entropy) of `batch` (`grpo_head_loss`)."""
        with attention_backends(batch.input_ids.device):
            h = self(batch.input_ids)
        return self._head_loss(
            h,
            self.norm,
            self.config.rms_norm_eps,
            self.head_weight(),
            batch.targets,
            batch.old_logprobs,
            batch.advantages,
            batch.loss_mask,
            eps_low,
            eps_high,
        )


def _copy_linear(dst: nn.Linear, src: nn.Module) -> None:
    if (dst.bias is None) != (getattr(src, "bias", None) is None):
        raise ValueError(f"bias mismatch copying {type(src).__name__} into the torch baseline")
    dst.weight.copy_(src.weight)
    if dst.bias is not None:
        dst.bias.copy_(src.bias)


# -- the step --------------------------------------------------------------------------------------------------
class TorchGrpoStep:
    """One GRPO step of a `TorchDecoder`: forward, loss, backward, then AdamW on fp32 masters (exactrl's
    MasterAdamW algorithm and memory shape, with torch's fused kernels; see the module docstring)."""

    def __init__(
        self,
        model: TorchDecoder,
        lr: float = 1e-5,
        max_grad_norm: float = 1.0,
        eps_low: float = 0.2,
        eps_high: float = 0.2,
    ):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_grad_norm, self.eps_low, self.eps_high = max_grad_norm, eps_low, eps_high
        self.has_master = any(p.dtype != torch.float32 for p in self.params)
        with torch.no_grad():
            self.master = (
                [p.detach().to(torch.float32, copy=True) for p in self.params]
                if self.has_master
                else self.params
            )
        # The multi-tensor norm has no CPU kernel: torch's own choice there (a per-tensor loop).
        self.foreach = True if self.params[0].device.type == "cuda" else None
        self.opt = torch.optim.AdamW(self.master, lr=lr, fused=True)

    def __call__(self, batch: GrpoBatch) -> dict[str, torch.Tensor]:
        """One step; returns its metrics as device tensors (reading them would wait for the device)."""
        loss, _, entropy = self.model.loss(batch, self.eps_low, self.eps_high)
        loss.backward()
        norm = self._optimizer_step()
        return {"loss": loss.detach(), "entropy": entropy, "grad_norm": norm}

    def _optimizer_step(self) -> torch.Tensor:
        if self.has_master:
            # fp32 gradients on the masters, allocated for the step and dropped after it (MasterAdamW's shape).
            for m in self.master:
                m.grad = torch.empty_like(m)
            torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.params])
            for p in self.params:
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.max_grad_norm, foreach=self.foreach)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.has_master:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.master)  # the new weights, rounded to the model dtype
        return norm.detach()


# -- environment ---------------------------------------------------------------------------------------------
def check_compile_available(device: torch.device | str) -> None:
    """Fail with what is missing when torch.compile cannot build kernels for `device`."""
    device = torch.device(device)
    cxx = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in cxx):
        raise RuntimeError(
            "bench train --vs torch compiles the baseline with torch.compile, which needs a C++ compiler on "
            "this machine (looked for $CXX, g++, c++, clang++ on PATH; none found). Install one (e.g. g++), or "
            "compare with --vs hf"
        )
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                f"bench train --vs torch compiles the baseline for CUDA with torch.compile, which needs Triton "
                f"({e}); install triton, or compare with --vs hf"
            ) from e


def attention_backends(device: torch.device) -> contextlib.AbstractContextManager:
    """On CUDA, SDPA restricted to PyTorch's flash kernel: an unsupported shape fails loudly instead of falling
    back to the memory-efficient or math kernels. The choice is made when the forward is traced (compiled) or
    run (eager), and the backward follows it. On the CPU, PyTorch's own choice."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


@contextlib.contextmanager
def stock_numerics() -> Iterator[None]:
    """PyTorch's default numerics switches for the block (exact mode turns reduced-precision reductions off and
    may turn deterministic algorithms on), restored after it: the baseline runs as a stock user's would."""
    from exactrl.ops import torch_determinism_off

    m = torch.backends.cuda.matmul
    saved = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_bf16_reduced_precision_reduction = True
    m.allow_fp16_reduced_precision_reduction = True
    try:
        with torch_determinism_off():
            yield
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process so far (its `unique_graphs` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
