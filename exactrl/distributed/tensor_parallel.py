"""Tensor parallel for the rollout engine that keeps the bits: T ranks each hold 1/T of the engine's weights and
of its KV cache, and every logit they sample from is bitwise the one-device engine's.

The rule that makes it exact by construction: **every output element is one in-order K loop on one rank.**

- Column splits keep an element's K loop whole: q/k/v (heads), gate/up (intermediate features), the LM head
  (vocabulary) hold a contiguous slice of their output rows; each rank computes its output columns from the
  whole input, with the same `linear` the one-device engine runs. The exact `linear` gives a column its bits
  whatever else is in the call: on the CPU measured (tests/distributed/test_tensor_parallel.py sweeps column
  slices against the full weight), on the GPU by the Triton GEMM's construction (the tile it picks may change
  with N, but every tile of its family runs the same in-order chain of MMAs per element: the property that already
  makes a row independent of M, exactrl/ops/triton/matmul.py).
- The layers that read what the split produced (o_proj reads the heads, down_proj the intermediate features)
  would be Megatron's row-parallel layers: each rank a slice of K, then an all-reduce of partial sums, which
  rounds differently from the one-device chain. Here they gather their input instead (`GatheredLinear`): an
  all-gather of the split features, in rank order, rebuilds the whole input on every rank; each rank computes a
  column slice of the output over the whole K; an all-gather rebuilds the whole output. Two all-gathers of [T, D]
  and [T, K] per layer instead of one all-reduce of [T, D]: more bytes, and no arithmetic in any collective.
- Attention is per head: a rank attends with its query heads and the KV heads they read, and caches only those.
  With num_kv_heads >= T the KV heads split like the query heads (T must divide both); with num_kv_heads < T
  (T a multiple of it) each rank holds the one KV head its query heads read, so T / num_kv_heads ranks hold
  copies of each KV head (vLLM does the same): the KV cache is then 1/num_kv_heads of the whole per rank.
- Everything else is replicated and computed identically on every rank: norms, residual adds, RoPE, the MoE
  router and its experts (a sparse layer's shared expert splits like a dense MLP), sampling. The embedding is
  split by vocabulary: each rank looks its rows up and an all-gather picks every token's row from its owner (a
  copy). The LM head's logits are gathered whole before the logprob and sampling ops, which see the row the
  one-device engine sees; the vocabulary is padded to a multiple of T with zero rows that are cut off after the
  gather.

Collectives move bits, never add: every gather here is an all-gather of the tensors' bytes.

LoRA adapters split as their projection does: a projection's output y = x W^T + s (x A^T) B^T, and the rank
computes its own output columns, so it holds the rows of B that match its rows of W and the whole A (A's K loop runs
over the whole input, which every rank has: the replicated hidden state, or the gathered input of o_proj /
down_proj). The low-rank product x A^T is then the one-device engine's, and each output column's B loop runs
whole on one rank: adapters are replicated in A and column-split in B, and the weight sync slices B as it slices W
(adapters only after each update, as on one device).

Not done (refused where configured): hidden or intermediate sizes that T does not divide. What a run needs of the
ranks: the T ranks of a group run the same engine calls in the same order (the same prompts, the same request ids):
the scheduler is deterministic and the logits every rank samples from are the same bits, so they stay in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from exactrl.model.config import ModelConfig
from exactrl.model.layers import MLP, Linear, PackedLinear
from exactrl.model.qwen import Attention, CausalLM
from exactrl.ops import Ops


@dataclass
class TensorParallelGroup:
    """The ranks that share one engine: `size` of them, this one at `rank` in the group; `group` the process
    group (None: the default group, every rank of the job). `dp_rank` / `dp_size`: which of the job's engines
    this is, and how many there are (the job's ranks split into consecutive groups of `size`)."""

    size: int
    rank: int
    group: Any = None
    dp_rank: int = 0
    dp_size: int = 1

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., n] on every rank -> [..., size * n], rank r's x at columns r*n .. (r+1)*n - 1, bit for bit
        (the bytes move as integers: a collective adds nothing here)."""
        return torch.cat(self.gather(x), dim=-1)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape and dtype everywhere), in rank order."""
        x = x.contiguous()
        xb = x.view(torch.uint8)  # bytes (gloo gathers uint8 whatever the dtype; a copy either way)
        parts = [torch.empty_like(xb) for _ in range(self.size)]
        dist.all_gather(parts, xb, group=self.group)
        return [p.view(x.dtype) for p in parts]

    def min(self, n: int) -> int:
        """The smallest of every rank's `n` (one all-reduce): what the ranks of one engine agree on where each has a
        figure of its own (the KV cache's blocks sized from its own free memory)."""
        if self.size == 1:
            return n
        cuda = dist.get_backend(self.group) == "nccl"
        t = torch.tensor([n], dtype=torch.int64, device="cuda" if cuda else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out


def tensor_parallel_groups(rank: int, world_size: int, size: int) -> TensorParallelGroup:
    """This rank's group when the job's `world_size` ranks split into consecutive groups of `size` (ranks
    0..size-1 share one engine, size..2*size-1 the next, ...). Every rank calls it (the groups are made
    collectively)."""
    if size < 1:
        raise ValueError(f"engine.tensor_parallel must be at least 1, got {size}")
    if world_size % size:
        raise ValueError(
            f"engine.tensor_parallel = {size} does not divide the world size {world_size}: every engine needs "
            f"{size} ranks of its own"
        )
    mine = None
    for start in range(0, world_size, size):
        ranks = list(range(start, start + size))
        g = dist.new_group(ranks=ranks) if size > 1 and size < world_size else None
        if rank in ranks:
            mine = g
    return TensorParallelGroup(size, rank % size, mine, rank // size, world_size // size)


# -- which rows of a full weight a rank holds ------------------------------------------------------------------
def _span(n: int, tp: TensorParallelGroup) -> slice:
    per = n // tp.size
    return slice(tp.rank * per, (tp.rank + 1) * per)


@dataclass(frozen=True)
class HeadSplit:
    """A rank's attention heads: query heads q0 .. q0 + num_heads - 1, KV heads kv0 .. kv0 + num_kv_heads - 1."""

    q0: int
    num_heads: int
    kv0: int
    num_kv_heads: int


def head_split(num_heads: int, num_kv_heads: int, tp: TensorParallelGroup) -> HeadSplit:
    t = tp.size
    if num_heads % t:
        raise ValueError(
            f"engine.tensor_parallel = {t} does not divide the model's {num_heads} attention heads: a rank holds "
            "whole heads"
        )
    if num_kv_heads % t and t % num_kv_heads:
        raise ValueError(
            f"engine.tensor_parallel = {t} and the model's {num_kv_heads} KV heads: one must divide the other (a "
            "rank holds whole KV heads, or one KV head its query heads share)"
        )
    hq = num_heads // t
    q0 = tp.rank * hq
    if num_kv_heads >= t:
        hkv = num_kv_heads // t
        return HeadSplit(q0, hq, tp.rank * hkv, hkv)
    # Fewer KV heads than ranks: the KV head this rank's query heads read (all of them read the same one, since
    # num_heads / T query heads divide the num_heads / num_kv_heads of a group).
    return HeadSplit(q0, hq, q0 // (num_heads // num_kv_heads), 1)


@torch.no_grad()
def _rows(full: torch.Tensor, pieces: list[tuple[int, int]]) -> torch.Tensor:
    """The rows [a, b) of each piece of `full`, concatenated (a new contiguous tensor)."""
    return torch.cat([full[a:b] for a, b in pieces]).contiguous()


# -- the split layers ---------------------------------------------------------------------------------------
class GatheredLinear(Linear):
    """o_proj / down_proj of a tensor-parallel engine: the input arrives split by features over the ranks; an
    all-gather makes it whole (K whole on every rank), the rank computes its slice of the output columns (its
    rows of the weight) with one in-order K loop per element, and an all-gather makes the output whole."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        tp: TensorParallelGroup,
        lora: nn.Module | None = None,
    ):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.lora = lora  # its B already cut to this rank's output rows (`_gathered`)
        self.tp = tp

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        x = self.tp.gather_last(x)  # [T, K]: the features of every rank, in rank order (= the unsplit order)
        # The base product and the adapter's term on the rank's output columns, as `Linear.forward` computes them.
        return self.tp.gather_last(super().forward(ops, x))


class VocabParallelEmbedding(nn.Module):
    """The embedding split by vocabulary (rows of `weight`: this rank's ids vocab_start .. + rows - 1). A
    token's row is looked up by the rank that holds it and copied to every rank by an all-gather."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, tp: TensorParallelGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_start, self.tp = vocab_start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < rows)
        out = nn.functional.embedding(
            torch.where(mine, local, 0), self.weight
        )  # others' tokens: ignored rows
        owner = ids // rows
        stacked = torch.stack(self.tp.gather(out))  # [size, T, D]
        return stacked[owner, torch.arange(ids.shape[0], device=ids.device)]


class EngineShardCausalLM(CausalLM):
    """A CausalLM split over the ranks of one engine (`shard_engine_model`, and for the experts
    `exactrl.distributed.expert_parallel.shard_experts`); the class is swapped in place, as FSDP2's `fully_shard`
    swaps a module's class. The decoder runs unchanged through the split layers; this class adds the LM head's
    gather (when the vocabulary is split), the number of KV heads the rank caches, and the map from full weights
    to the rank's slices (`shard_full_weight`, the weight sync's way in)."""

    shard_group: TensorParallelGroup
    vocab_split: bool  # the LM head holds this rank's vocabulary rows (tensor parallel)
    shard_kv_heads: int
    shard_slicers: dict[str, Any]

    @property
    def kv_heads(self) -> int:
        return self.shard_kv_heads

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, D] -> [R, V]: this rank's vocabulary columns (whole K loops), gathered whole, padding cut off."""
        if not self.vocab_split:
            return super().head_logits(hidden)
        h, w = self.head_inputs(hidden)
        full = self.shard_group.gather_last(self.ops.linear(h, w))
        return full[:, : self.config.vocab_size]

    def logits(self, hidden: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        return self.ops.scale_logits(self.head_logits(hidden), temperature)

    def logprobs(self, hidden, targets, temperature: float = 1.0, with_entropy: bool = False):
        if not self.vocab_split:
            return super().logprobs(hidden, targets, temperature, with_entropy)
        if with_entropy:
            raise ValueError("an engine shard with a split vocabulary records logprobs, not entropies")
        return self.ops.logprobs_from_logits(self.head_logits(hidden), targets, temperature), None

    @torch.no_grad()
    def shard_full_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """The rank's slice of the full (unsplit) weight `name`, as the engine shard holds it: what the weight
        sync copies into the shard's own tensor."""
        slicer = self.shard_slicers.get(name)
        return full if slicer is None else slicer(full)


def as_engine_shard(model: CausalLM, group: TensorParallelGroup) -> EngineShardCausalLM:
    """`model` as an EngineShardCausalLM over `group` (nothing split yet, unless it was one already)."""
    if not isinstance(model, EngineShardCausalLM):
        model.__class__ = EngineShardCausalLM
        model.shard_group, model.vocab_split = group, False
        model.shard_kv_heads, model.shard_slicers = model.config.num_kv_heads, {}
    return model


def check_tensor_parallel(model: CausalLM, size: int) -> None:
    """Refuse, by key, what `shard_engine_model` does not do (before any group is made)."""
    check_tensor_parallel_shape(model.config, size)


def check_tensor_parallel_shape(cfg: ModelConfig, size: int) -> None:
    """`check_tensor_parallel` from the model's config alone (nothing built: `exactrl plan`, the run's preflight)."""
    key = f"engine.tensor_parallel = {size}"
    if size == 1:
        return
    head_split(cfg.num_heads, cfg.num_kv_heads, TensorParallelGroup(size, 0))
    for what, n in (("hidden_size", cfg.hidden_size), ("intermediate_size", cfg.intermediate_size)):
        if n % size:
            raise ValueError(f"{key} does not divide the model's {what} {n}: a rank computes whole columns")
    if cfg.has_shared_expert and cfg.shared_expert_intermediate_size % size:
        raise ValueError(
            f"{key} does not divide the model's shared_expert_intermediate_size "
            f"{cfg.shared_expert_intermediate_size}"
        )


def kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """The KV heads one rank of a tensor-parallel engine caches: num_kv_heads / T, or one (a copy) when the model
    has fewer KV heads than ranks (`head_split`)."""
    return num_kv_heads // size if num_kv_heads >= size else 1


@torch.no_grad()
def shard_engine_model(model: CausalLM, tp: TensorParallelGroup) -> CausalLM:
    """Split `model` (the engine's own full-weight model in the model dtype, never the trainer's) over the group,
    in place: every split weight replaced by the rank's slice, o_proj / down_proj by `GatheredLinear`, the
    embedding by `VocabParallelEmbedding`, the class by `EngineShardCausalLM`. Returns the model."""
    check_tensor_parallel(model, tp.size)
    if tp.size == 1:
        return model
    cfg = model.config
    dh = cfg.head_dim
    slicers: dict[str, Any] = {}
    hs = head_split(cfg.num_heads, cfg.num_kv_heads, tp)
    q_rows = (hs.q0 * dh, (hs.q0 + hs.num_heads) * dh)
    kv_rows = (hs.kv0 * dh, (hs.kv0 + hs.num_kv_heads) * dh)

    def attention(prefix: str, attn: Attention) -> None:
        qkv = attn.qkv_proj
        q, kv = cfg.num_heads * dh, cfg.num_kv_heads * dh
        pieces = [q_rows, (q + kv_rows[0], q + kv_rows[1]), (q + kv + kv_rows[0], q + kv + kv_rows[1])]
        _split_packed(prefix + "self_attn.", "qkv_proj", qkv, pieces, slicers)
        qkv.parts = {
            "q_proj": hs.num_heads * dh,
            "k_proj": hs.num_kv_heads * dh,
            "v_proj": hs.num_kv_heads * dh,
        }
        attn.num_heads, attn.num_kv_heads = hs.num_heads, hs.num_kv_heads
        attn.o_proj = _gathered(prefix + "self_attn.o_proj", attn.o_proj, tp, slicers)

    def mlp(prefix: str, m: MLP) -> None:
        inter = m.down_proj.weight.shape[1]
        span = _span(inter, tp)
        pieces = [(span.start, span.stop), (inter + span.start, inter + span.stop)]
        _split_packed(prefix, "gate_up_proj", m.gate_up_proj, pieces, slicers)
        m.gate_up_proj.parts = {k: span.stop - span.start for k in m.gate_up_proj.parts}
        m.down_proj = _gathered(prefix + "down_proj", m.down_proj, tp, slicers)

    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        attention(prefix, layer.self_attn)
        if isinstance(layer.mlp, MLP):
            mlp(prefix + "mlp.", layer.mlp)
        elif getattr(layer.mlp, "shared_expert", None) is not None:
            mlp(prefix + "mlp.shared_expert.", layer.mlp.shared_expert)

    # The vocabulary, padded to a multiple of T with zero rows (their logits are cut off after the gather).
    v = cfg.vocab_size
    per = -(-v // tp.size)
    lo = tp.rank * per

    def vocab_rows(full: torch.Tensor) -> torch.Tensor:
        part = full[lo : min(lo + per, v)]
        if part.shape[0] < per:
            part = torch.cat([part, part.new_zeros(per - part.shape[0], *part.shape[1:])])
        return part.contiguous()

    emb = model.model.embed_tokens
    model.model.embed_tokens = VocabParallelEmbedding(vocab_rows(emb.weight), lo, tp)
    slicers["model.embed_tokens.weight"] = vocab_rows
    if model.lm_head is not None:
        model.lm_head.weight = nn.Parameter(vocab_rows(model.lm_head.weight), requires_grad=False)
        slicers["lm_head.weight"] = vocab_rows

    shard = as_engine_shard(model, tp)
    shard.vocab_split, shard.shard_kv_heads = True, hs.num_kv_heads
    shard.shard_slicers.update(slicers)
    return shard


def _split_packed(
    prefix: str, name: str, layer: PackedLinear, pieces: list[tuple[int, int]], slicers: dict[str, Any]
) -> None:
    """Keep the rows `pieces` (one per part, in part order) of a packed projection's weight (and bias) and of
    each targeted part's LoRA B; register how a full tensor maps to them under the parameter's name (the one
    `named_parameters` gives)."""

    def take(full: torch.Tensor) -> torch.Tensor:
        return _rows(full, pieces)

    layer.whole_parts = list(layer.parts.values())  # fp8: the whole weight is blocked by these parts
    layer.weight = nn.Parameter(take(layer.weight), requires_grad=False)
    slicers[f"{prefix}{name}.weight"] = take
    if layer.bias is not None:
        layer.bias = nn.Parameter(take(layer.bias), requires_grad=False)
        slicers[f"{prefix}{name}.bias"] = take
    # Part i's LoRA B holds that part's rows only: the piece, counted from the part's first row (kept for adapters
    # attached after the split, `shard_adapters`).
    starts = [0]
    for n in layer.parts.values():
        starts.append(starts[-1] + n)
    layer.shard_rows = [(a - s0, b - s0) for (a, b), s0 in zip(pieces, starts)]
    if layer.lora is not None:
        _split_adapter(f"{prefix}{name}", layer, slicers)


def _split_adapter(name: str, layer: Linear, slicers: dict[str, Any]) -> None:
    """The rows `layer.shard_rows` of each targeted part's LoRA B (`lora_B_<i>`, [out of part i, r]), kept (a B
    attached before the split is cut; one attached after it has those rows already); its slicer registered."""
    for i, _ in layer.lora.targets:
        a, b = layer.shard_rows[i]

        def take(full: torch.Tensor, a: int = a, b: int = b) -> torch.Tensor:
            return full[a:b].contiguous()

        key = f"lora_B_{i}"
        held = getattr(layer.lora, key)
        if held.shape[0] != b - a:
            setattr(layer.lora, key, nn.Parameter(take(held), requires_grad=False))
        slicers[f"{name}.lora.{key}"] = take


def shard_adapters(model: nn.Module) -> None:
    """LoRA adapters attached to an engine already split by tensor parallel (a generator's, after the split):
    register how the whole adapters map to the rank's (B's rows with its projection's; A whole). A no-op on a
    model that is not a tensor-parallel shard."""
    if not isinstance(model, EngineShardCausalLM):
        return
    for name, m in model.named_modules():
        if isinstance(m, Linear) and m.lora is not None and getattr(m, "shard_rows", None) is not None:
            _split_adapter(name, m, model.shard_slicers)


def _gathered(name: str, layer: Linear, tp: TensorParallelGroup, slicers: dict[str, Any]) -> GatheredLinear:
    """`layer` ([N, K]) as a GatheredLinear holding its rank's N / T output rows."""
    span = _span(layer.weight.shape[0], tp)

    def take(full: torch.Tensor) -> torch.Tensor:
        return full[span].contiguous()

    slicers[f"{name}.weight"] = take
    bias = None
    if layer.bias is not None:
        slicers[f"{name}.bias"] = take
        bias = take(layer.bias)
    out = GatheredLinear(take(layer.weight), bias, tp, layer.lora)
    out.shard_rows = [(span.start, span.stop)]
    if out.lora is not None:
        _split_adapter(name, out, slicers)
    return out


# -- for comparison only: Megatron's row-parallel arithmetic (not bit-exact) ---------------------------------------
class RowParallelLinear(nn.Module):
    """o_proj / down_proj as Megatron's row-parallel layer: the rank holds the K columns of its own input features
    (the heads or intermediate features its column-split layer produced), computes the partial product over them,
    and the ranks all-reduce (sum) the partials. One all-reduce of [T, D] instead of `GatheredLinear`'s two
    all-gathers, and K cut over the ranks: the rounding differs from one device. Never used by a run: the tests'
    negative control and benchmarks/decode_split.py's baseline (what keeping the bits costs)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallelGroup):
        super().__init__()
        k = weight.shape[1] // tp.size
        self.weight = nn.Parameter(
            weight[:, tp.rank * k : (tp.rank + 1) * k].contiguous(), requires_grad=False
        )
        self.bias = (
            None if bias is None or tp.rank else nn.Parameter(bias.detach().clone(), requires_grad=False)
        )
        self.tp = tp

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        y = ops.linear(x, self.weight, self.bias)
        dist.all_reduce(y, group=self.tp.group)
        return y


def row_parallel_reference(full: CausalLM, tp: TensorParallelGroup) -> CausalLM:
    """A split engine model from the whole model `full` (left as it is) whose o_proj / down_proj are
    `RowParallelLinear`: the all-reduce form of the same split, for comparison (see RowParallelLinear)."""
    import copy

    model = shard_engine_model(copy.deepcopy(full), tp)
    whole = dict(full.named_modules())
    for name, m in list(model.named_modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, GatheredLinear):
                src = whole[f"{name}.{child_name}" if name else child_name]
                setattr(m, child_name, RowParallelLinear(src.weight, src.bias, tp))
    return model
