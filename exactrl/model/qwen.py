"""The decoder of Qwen2, Qwen3, Llama and the Qwen MoE models, written once for both paths.

The families are one decoder with options (`ModelConfig`): Qwen3 adds a per-head q/k RMSNorm, Qwen2 has q/k/v
biases, Llama may have attention (q/k/v/o) and MLP biases; each may scale its RoPE (`exactrl.model.rope`).
Qwen3-MoE and Qwen2-MoE are Qwen3 and Qwen2 whose sparse layers replace the MLP by a mixture of experts
(`exactrl.model.moe`).

Single-device code over flat token streams (`[T, ...]`, packed sequences, no padding inside the model). The
forward takes token ids, absolute positions and an `AttentionBatch` that says either "these are whole packed
sequences" (training) or "this is a step against the paged KV cache" (rollout). Every numeric op goes through
`self.ops`, so the engine and the trainer run the same arithmetic on the same module.

The projections that read one input are packed into one weight (`qkv_proj`: q, k, v; `gate_up_proj`: gate, up),
so each is one matmul forward and one dX matmul backward. With the Triton matmul a packed output column has the
bits of the unpacked projection's, since the kernel reduces every output element over K the same way whatever
the width of N (`tests/ops/test_triton_gpu.py` checks it); either way both paths use the packed weight. The
state dict speaks HF's names (`model.layers.3.self_attn.q_proj.weight`): `state_dict()` splits a packed weight
into its parts and `load_state_dict()` packs them, so checkpoints map one to one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exactrl.model.config import ModelConfig
from exactrl.model.init import INIT_DRAWS, keyed_normal_into, normal_into
from exactrl.model.layers import MLP, Linear, PackedLinear, RMSNorm, pack_state_dict
from exactrl.model.moe import SparseMoeBlock
from exactrl.ops import AttentionBatch, Ops, get_ops
from exactrl.progress import Progress, amount


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias)
        self.o_proj = Linear(q, cfg.hidden_size, cfg.o_bias)
        pack_state_dict(self, "qkv_proj")
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, ops: Ops, x, positions, cos_sin, batch: AttentionBatch, kv_cache=None):
        T = x.shape[0]
        q, k, v = self.qkv_proj(ops, x)  # views with the packed row stride
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        written = False
        if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
            # Qwen3: RMSNorm over each head, then RoPE, for q and k in one op; against the cache the op also writes
            # K and V (one launch on the GPU: a decode step of few sequences is bound by its launches). Both norms
            # take cfg.rms_norm_eps.
            q, k = ops.qk_norm_rope(
                q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, positions, cos_sin,
                kv_cache, None if kv_cache is None else batch.slot_mapping,
            )  # fmt: skip
            written = kv_cache is not None
        else:
            q = ops.rope(q, positions, cos_sin)
            k = ops.rope(k, positions, cos_sin)
        o = ops.attention(q, k, v, batch, kv_cache, kv_written=written)
        return self.o_proj(ops, o.reshape(T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A mixture of experts or the dense MLP, by transformers' rule for this layer (ModelConfig.is_moe_layer).
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def forward(
        self,
        ops: Ops,
        pending: torch.Tensor | None,
        h: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(pending, h) -> (this layer's MLP output, not yet added; the residual stream it is to be added to).

        `pending` is the previous sublayer's output, not yet added to the residual stream h (None before the first
        layer): each residual add is fused with the norm after it, `add_rms_norm` rounding the sum as HF's
        `residual + hidden_states` does. The caller adds the returned pending output into the next norm."""
        n = self.input_layernorm
        if pending is None:
            x = ops.rms_norm(h, n.weight, n.eps)
        else:
            x, h = ops.add_rms_norm(pending, h, n.weight, n.eps)
        attn = self.self_attn(ops, x, positions, cos_sin, batch, kv_cache)
        n = self.post_attention_layernorm
        x, h = ops.add_rms_norm(attn, h, n.weight, n.eps)
        return self.mlp(ops, x), h


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Its weight made as `Linear`'s are, without nn.Embedding's own init: every model is built on the meta
        # device and then drawn (`init_weights`) or loaded, and a meta tensor's normal_ goes through torch's Python
        # reference, which imports torch._dynamo (about 0.5 s at every process start on a 2-core CPU).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Qwen2/Qwen3/Llama (and their MoE) causal LM. `forward` returns final hidden states; `logprobs`/`logits` apply the LM head
    through the ops backend (fp32 log-softmax, temperature inside the op)."""

    def __init__(self, cfg: ModelConfig, ops: Ops | None = None, fp32_lm_head: bool = False):
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.ops: Ops = ops if ops is not None else get_ops("cpu", exact=True)
        self.fp32_lm_head = fp32_lm_head
        self._cos_sin: torch.Tensor | None = None
        self.lora_spec: Any = None  # exactrl.model.lora.LoraSpec once add_lora attached adapters

    # -- construction ------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(
        self, seed: int = 0, std: float = 0.02, desc: str | None = None, draws: str = "stream"
    ) -> CausalLM:
        """Random init as HF does for Qwen (normal(0, 0.02) for matrices, ones for norms, zeros for biases).

        draws="stream" (the default, the presets' values as they have always been): one CPU generator draws every
        matrix in parameter order, fp32 normal(0, 1) times std rounded to the parameter's dtype: the same values on
        every device and dtype, drawn on one core. draws="keyed": each matrix (each part of a packed one, under
        the unpacked model's name) from its own generator seeded by (seed, name), drawn on several threads at once
        (`exactrl.model.init.keyed_normal_into`): other values than "stream", the same on every device, dtype and
        thread count. Drawn in place, chunk by chunk (`exactrl.model.init`), with progress shown when it takes a
        while (desc: what to call the phase)."""
        if draws not in INIT_DRAWS:
            raise ValueError(f"draws must be one of {INIT_DRAWS}, got {draws!r}")
        g = torch.Generator().manual_seed(seed)
        packed = {f"{n}.weight": m for n, m in self.named_modules() if isinstance(m, PackedLinear)}
        # adapters have their own init (exactrl.model.lora.add_lora)
        todo = [(n, p) for n, p in self.named_parameters() if ".lora." not in n]
        total = sum(p.numel() for _, p in todo)
        keyed: list[tuple[str, torch.Tensor]] = []
        with Progress(desc or "initialising weights", total, "params") as bar:
            for name, p in todo:
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                    bar.update(p.numel())
                elif name.endswith(".bias"):
                    p.zero_()
                    bar.update(p.numel())
                else:  # a packed weight part by part, in HF's order: the draws of the unpacked model
                    parts = packed[name].parts if name in packed else {"": p.shape[0]}
                    for part, piece in zip(parts, p.split(list(parts.values()), dim=0)):
                        if draws == "stream":
                            normal_into(piece, std, g, bar.update)
                        else:  # the unpacked model's name of the part
                            keyed.append((f"{name.rsplit('.', 2)[0]}.{part}.weight" if part else name, piece))
            keyed_normal_into(keyed, std, seed, bar.update)
        return self

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def kv_heads(self) -> int:
        """The KV heads each attention layer of this model object computes and caches: config.num_kv_heads (a
        tensor-parallel engine shard holds fewer, exactrl/distributed/tensor_parallel.py)."""
        return self.config.num_kv_heads

    def rope_table(self, device: torch.device) -> torch.Tensor:
        """fp32 [max_pos, head_dim] table: cos of each frequency in the first half, sin in the second (both
        times the RoPE scaling's attention factor, 1 but for YaRN).

        Built once per device in float64 then rounded, whatever the model dtype, and indexed by absolute
        position on both paths."""
        if self._cos_sin is None or self._cos_sin.device != device:
            self._cos_sin = self.config.rope_table().to(device)
        return self._cos_sin

    # -- forward -----------------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, D] in the model dtype.

        kv_caches: None for packed whole sequences (training), else one (k_cache, v_cache) per layer, each
        [num_blocks, block_size, Hkv, Dh], written at batch.slot_mapping."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be flat [T] tensors, got {tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        # Checked on the host-side batch description: reading positions.max() would sync the device every step.
        if batch.max_key_len > self.config.max_position_embeddings:
            raise ValueError(
                f"position {batch.max_key_len - 1} is past max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        ops = self.ops
        cos_sin = self.rope_table(input_ids.device)
        h = self.model.embed_tokens(input_ids)
        pending = None  # the last sublayer output, added to the residual stream h by the next (fused) norm
        for i, layer in enumerate(self.model.layers):
            pending, h = layer(
                ops, pending, h, positions, cos_sin, batch, None if kv_caches is None else kv_caches[i]
            )
        n = self.model.norm  # the last MLP output is added here (config.validate() requires a layer)
        assert pending is not None
        return ops.add_rms_norm(pending, h, n.weight, n.eps)[0]

    def head_inputs(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, LM-head weight) as the LM head consumes them (fp32 with fp32_lm_head)."""
        w = self.lm_head_weight()
        if self.fp32_lm_head:  # LM head and softmax in fp32 from bf16 hidden states, on both paths
            return hidden.float(), w.float()
        return hidden, w

    def shard_full_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The part of the full (unsplit) parameter `name` this model object holds: all of it (a tensor-parallel
        engine shard holds its rank's slice): what a weight sync copies into the parameter."""
        return full

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, D] -> [R, V] raw LM-head output (`linear`, model dtype or fp32 with fp32_lm_head): the rows
        the engine samples from and records logprobs of (`Ops.scale_logits`, `Ops.logprobs_from_logits`)."""
        h, w = self.head_inputs(hidden)
        return self.ops.linear(h, w)

    def logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [T, D], targets: [T] -> (logprobs [T] fp32, entropy [T] fp32 or None) at `temperature`."""
        h, w = self.head_inputs(hidden)
        return self.ops.logprobs(h, w, targets, temperature, with_entropy)

    def logits(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """hidden: [T, D] -> [T, V] fp32 logits / temperature, the numbers `logprobs` normalises."""
        h, w = self.head_inputs(hidden)
        return self.ops.logits(h, w, temperature)

    def set_ops(self, ops: Ops) -> None:
        self.ops = ops

    def flops_per_token(self, context: int = 0) -> float:
        """Forward matmul FLOPs per token (2 * params in matmuls + attention at the given context length); a
        mixture of experts counts the k experts a token is routed to (`num_active_params`)."""
        cfg = self.config
        # The embedding lookup does no matmul; a tied LM head is counted once in num_params and does one.
        n = cfg.num_active_params() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
        attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * context
        return 2.0 * n + attn


def build_model(
    cfg: ModelConfig,
    device="cpu",
    dtype=torch.float32,
    exact: bool = True,
    seed: int = 0,
    fp32_lm_head: bool = False,
    name: str | None = None,
    init_draws: str = "stream",
) -> CausalLM:
    """A randomly initialised model on `device` with the ops backend for (device, exact). name: what to call it
    in the progress lines (a preset's name). init_draws: `CausalLM.init_weights`'s draws.

    The parameters are made where and as they live (`dtype` on `device`) and drawn in place: the values of an fp32
    model drawn on the CPU and then cast and moved, with no fp32 copy of the whole model on the host."""
    with torch.device("meta"):
        model = CausalLM(cfg, ops=get_ops(device, exact), fp32_lm_head=fp32_lm_head)
    model = model.to(dtype=dtype).to_empty(device=device)
    n = sum(p.numel() for p in model.parameters())
    what = name or f"a {cfg.architecture} model"
    model.init_weights(
        seed,
        desc=f"random weights of {what} ({amount(n, 'params')}, {dtype_name(dtype)}, {device})",
        draws=init_draws,
    )
    return model


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "MLP",
    "CausalLM",
    "Linear",
    "ModelConfig",
    "PackedLinear",
    "RMSNorm",
    "SparseMoeBlock",
    "build_model",
    "count_params",
    "pack_state_dict",
]
