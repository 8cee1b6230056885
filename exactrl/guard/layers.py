"""Where the engine's and the trainer's computations of one sequence part: the first decoder layer whose output
differs between an engine prefill of the sequence (paged KV cache) and the trainer's packed forward of it.

Both sides run the same model object, so forward hooks on `model.model.layers` see both. A layer's output is
the pair (its sublayer output not yet added, the residual stream): both are compared, row by row, by absolute
position. The probe is cheap (one prefill and one forward of one sequence) and answers a narrower question than
the rollout did: a decode-step fault that a prefill does not share shows as "every layer equal", and the report
says so rather than guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from exactrl.model.qwen import CausalLM


@dataclass
class LayerProbe:
    """layer: the first decoder layer (0-based) whose output differs, None when none does; position: the first
    differing row's absolute position in that layer; final_equal: whether the final hidden states (after the
    last norm) are equal; num_layers: how many layers were compared."""

    layer: int | None
    position: int | None
    final_equal: bool
    num_layers: int

    def describe(self) -> str:
        if self.layer is not None:
            return (
                f"first differing layer: {self.layer} (of {self.num_layers}, 0-based; engine prefill vs trainer "
                f"forward, first at position {self.position})"
            )
        if not self.final_equal:
            return (
                f"all {self.num_layers} layers equal; the final norm's output differs (engine prefill vs trainer "
                "forward)"
            )
        return (
            f"engine prefill and trainer forward agree at every layer ({self.num_layers}) and after the final "
            "norm: the difference is in the LM head / logprob op, or only on the decode path"
        )


class _Recorder:
    """Forward hooks that keep each layer's (pending, residual) output per absolute position."""

    def __init__(self, model: CausalLM) -> None:
        self.rows: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in model.model.layers]
        self.handles = [
            layer.register_forward_hook(self._hook(i)) for i, layer in enumerate(model.model.layers)
        ]

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
    train_rows = rec.rows
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
    engine_rows = rec.rows
    for i, (tr, en) in enumerate(zip(train_rows, engine_rows)):
        for p in range(n):
            if p not in en or p not in tr:
                raise RuntimeError(f"layer probe: position {p} was not computed at layer {i}")
            (tp, th), (ep, eh) = tr[p], en[p]
            if not (torch.equal(tp, ep) and torch.equal(th, eh)):
                return LayerProbe(i, p, False, len(train_rows))
    final_equal = all(torch.equal(final_train[p], finals[p]) for p in range(n))
    return LayerProbe(None, None, final_equal, len(train_rows))
