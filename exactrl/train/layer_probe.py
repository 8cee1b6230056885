"""Where the engine's and the trainer's computations of one sequence part: the first decoder layer whose output
differs between an engine prefill of the sequence (paged KV cache) and the trainer's packed forward of it.

Both sides run the same model object, so forward hooks on `model.model.layers` see both. A layer's output is
the pair (its sublayer output not yet added, the residual stream): both are compared, row by row, by absolute
position. The probe is cheap (one prefill and one forward of one sequence) and answers a narrower question than
the rollout did: a decode-step fault that a prefill does not share shows as "every layer equal", and the report
says so rather than guess.

When the first differing layer is a mixture of experts, the probe looks inside it (`ExpertProbe`): the block's
input, the routing each side's block itself recorded (`exactrl.model.moe.collect_router_outputs`), and each routed
expert's output for each token computed alone with the weights that side's block held at that moment. It says
whether the router picked different experts (which token, which experts) or the same experts gave different bits
(which expert), or that the difference came in before the experts (attention, norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.model.moe import RouterCollector, SparseMoeBlock, collect_router_outputs
from exactrl.model.qwen import CausalLM


@dataclass
class ExpertProbe:
    """Inside a sparse layer whose output differs, the earliest cause found, in this order:

    finding: "input" (the block's input already differs: attention or a norm of the layer), "routing" (the router
    picked different experts for a token), "router_logits" (the same experts, different router logits, hence
    routing weights), "expert" (the same experts; one expert's output for a token differs), "combine" (the same
    experts, each equal alone: the weighted sum or the shared expert differs). position / token_id: the first
    token concerned; engine_experts / trainer_experts: its top-k (rank order) on each side; expert: the expert
    whose output differs."""

    layer: int
    finding: str
    position: int | None = None
    token_id: int | None = None
    engine_experts: list[int] | None = None
    trainer_experts: list[int] | None = None
    expert: int | None = None

    def describe(self) -> str:
        at = f"position {self.position} (token id {self.token_id})"
        if self.finding == "input":
            return (
                f"layer {self.layer} is a mixture of experts, but its input already differs at {at}: the "
                "attention or a norm of the layer, before the router"
            )
        if self.finding == "routing":
            return (
                f"layer {self.layer}: the router picked different experts at {at}: engine experts "
                f"{self.engine_experts}, trainer experts {self.trainer_experts}"
            )
        if self.finding == "router_logits":
            return (
                f"layer {self.layer}: the router picked the same experts for every token, but its logits differ "
                f"at {at} (experts {self.engine_experts}): different routing weights"
            )
        if self.finding == "expert":
            return (
                f"layer {self.layer}: the router picked the same experts for every token; expert {self.expert} "
                f"gave different bits at {at} (its experts {self.engine_experts})"
            )
        return (
            f"layer {self.layer}: the same experts for every token, each giving the same bits alone: the "
            "weighted combine of the experts or the shared expert differs"
        )


@dataclass
class LayerProbe:
    """layer: the first decoder layer (0-based) whose output differs, None when none does; position: the first
    differing row's absolute position in that layer; final_equal: whether the final hidden states (after the
    last norm) are equal; num_layers: how many layers were compared."""

    layer: int | None
    position: int | None
    final_equal: bool
    num_layers: int
    experts: ExpertProbe | None = None  # a sparse first differing layer: what differs inside it

    def describe(self) -> str:
        if self.layer is not None:
            head = (
                f"first differing layer: {self.layer} (of {self.num_layers}, 0-based; engine prefill vs trainer "
                f"forward, first at position {self.position})"
            )
            return head if self.experts is None else f"{head}; {self.experts.describe()}"
        if not self.final_equal:
            return (
                f"all {self.num_layers} layers equal; the final norm's output differs (engine prefill vs trainer "
                "forward)"
            )
        return (
            f"engine prefill and trainer forward agree at every layer ({self.num_layers}) and after the final "
            "norm: the difference is in the LM head / logprob op, or only on the decode path"
        )


@dataclass
class _MoeRow:
    """One token at one sparse layer: the block's input, its router logits and top-k ids as the block recorded
    them, and each rank's expert output for the token alone ([k, D])."""

    x: torch.Tensor
    logits: torch.Tensor
    ids: torch.Tensor
    expert_out: torch.Tensor


class _Recorder:
    """Forward hooks that keep each layer's (pending, residual) output per absolute position, and inside the
    sparse layers what `_MoeRow` holds."""

    def __init__(self, model: CausalLM) -> None:
        layers = model.model.layers
        self.rows: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in layers]
        self.moe: dict[int, dict[int, _MoeRow]] = {}
        self._positions: dict[int, torch.Tensor] = {}
        self.handles = [layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]
        for i, layer in enumerate(layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                self.moe[i] = {}
                self.handles.append(layer.register_forward_pre_hook(self._pre_hook(i)))
                self.handles.append(layer.mlp.register_forward_hook(self._moe_hook(i)))
        self._collecting = collect_router_outputs(model)
        self.router: RouterCollector = self._collecting.__enter__()

    def _pre_hook(self, i: int):
        def hook(module, args) -> None:
            self._positions[i] = args[3]  # the block below sees only (ops, x): its rows' positions, from here

        return hook

    def _moe_hook(self, i: int):
        def hook(block: SparseMoeBlock, args, out) -> None:
            ops, x = args[0], args[1]
            rec = self.router.records[-1]  # this very call's routing, recorded by the block itself
            assert rec.layer == i, (rec.layer, i)
            # Each rank's expert alone, weight 1.0 (the combine then rounds the expert's own output once, to the
            # same bits), through the same invariant op, with the weights this side's block holds right now.
            ones = torch.ones(x.shape[0], 1, dtype=torch.float32, device=x.device)
            g, d = block.experts.gate_up, block.experts.down
            alone = [ops.moe_experts(x, g, d, ones, rec.ids[:, r : r + 1]) for r in range(rec.ids.shape[1])]
            per_rank = torch.stack(alone, dim=1)  # [T, k, D]
            for r, p in enumerate(self._positions[i].tolist()):
                self.moe[i][p] = _MoeRow(
                    x[r].detach().cpu().clone(),
                    rec.logits[r].detach().cpu().clone(),
                    rec.ids[r].cpu().clone(),
                    per_rank[r].detach().cpu().clone(),
                )

        return hook

    def _hook(self, i: int):
        def hook(module, args, out) -> None:
            positions = args[3]  # DecoderLayer.forward(ops, pending, h, positions, cos_sin, batch, kv_cache)
            pending, h = out
            for r, p in enumerate(positions.tolist()):
                self.rows[i][p] = (pending[r].detach().cpu().clone(), h[r].detach().cpu().clone())

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self._collecting.__exit__(None, None, None)


def _inside_experts(
    layer: int, trainer: dict[int, _MoeRow], engine: dict[int, _MoeRow], seq: list[int]
) -> ExpertProbe:
    """The earliest cause inside a sparse layer whose output differs (see ExpertProbe), position by position."""
    positions = sorted(trainer)

    def found(finding: str, p: int, **kw) -> ExpertProbe:
        return ExpertProbe(
            layer,
            finding,
            p,
            seq[p],  # the input token at position p
            engine_experts=engine[p].ids.tolist(),
            trainer_experts=trainer[p].ids.tolist(),
            **kw,
        )

    for p in positions:
        if not torch.equal(trainer[p].x, engine[p].x):
            return found("input", p)
    for p in positions:
        if not torch.equal(trainer[p].ids, engine[p].ids):
            return found("routing", p)
    for p in positions:
        if not torch.equal(trainer[p].logits, engine[p].logits):
            return found("router_logits", p)
    for p in positions:
        for r, e in enumerate(trainer[p].ids.tolist()):
            if not torch.equal(trainer[p].expert_out[r], engine[p].expert_out[r]):
                return found("expert", p, expert=e)
    return ExpertProbe(layer, "combine")


@torch.no_grad()
def probe_layers(
    model: CausalLM, prompt_ids: list[int], completion_ids: list[int], max_model_len: int | None = None
) -> LayerProbe:
    """Compare, layer by layer, the engine's prefill of prompt + completion (all but the last token, the rows
    whose outputs predict the completion) with the trainer's forward of the same sequence."""
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.train.packing import PackedBatch

    seq = list(prompt_ids) + list(completion_ids)
    inputs = seq[:-1]
    n = len(inputs)
    # The trainer's side: the packed forward the training step runs (inputs are the sequence minus its last token).
    rec = _Recorder(model)
    try:
        pb = PackedBatch.build([seq], [len(prompt_ids)], model.device)
        final_train = model(pb.input_ids, pb.batch.q_pos, pb.batch).cpu()
    finally:
        rec.remove()
    train_rows, train_moe = rec.rows, rec.moe
    # The engine's side: a prefill of the same rows through the paged cache (a fresh engine: no prefix-cache
    # hit may skip a row), sampling one token so that the call ends after the prefill.
    rec = _Recorder(model)
    finals: dict[int, torch.Tensor] = {}
    real_forward = model.forward

    def keep_final(input_ids, positions, batch, kv_caches=None):
        out = real_forward(input_ids, positions, batch, kv_caches)
        for r, p in enumerate(positions.tolist()):
            finals[p] = out[r].detach().cpu().clone()
        return out

    model.forward = keep_final  # type: ignore[method-assign]
    try:
        cfg = EngineConfig(
            max_model_len=max(n + 1, max_model_len or 0),
            enable_prefix_caching=False,
            cuda_graphs=False,
            max_num_batched_tokens=max(n, 16),
            prefill_chunk_size=max(n, 16),
        )
        RolloutEngine(model, cfg).generate([inputs], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        del model.forward
        rec.remove()
    engine_rows, engine_moe = rec.rows, rec.moe
    for i, (tr, en) in enumerate(zip(train_rows, engine_rows)):
        for p in range(n):
            if p not in en or p not in tr:
                raise RuntimeError(f"layer probe: position {p} was not computed at layer {i}")
            (tp, th), (ep, eh) = tr[p], en[p]
            if not (torch.equal(tp, ep) and torch.equal(th, eh)):
                inside = _inside_experts(i, train_moe[i], engine_moe[i], seq) if i in train_moe else None
                return LayerProbe(i, p, False, len(train_rows), inside)
    final_equal = all(torch.equal(final_train[p], finals[p]) for p in range(n))
    return LayerProbe(None, None, final_equal, len(train_rows))
