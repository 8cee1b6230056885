"""One RL optimizer step: packed microbatches through the shared model, the policy (and value) loss, AdamW.

In exact mode the engine's rollout logprobs *are* the old logprobs (bitwise equal to what this forward computes
before the update), so there is no recompute pass; the first minibatch of every step checks that for free and
logs the `mismatch/*` metrics. In fast mode the old logprobs are recomputed here, and rollout correction
(TIS / MIS) can weigh the difference to the engine's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch.distributed.tensor import DTensor

from exactrl.algorithms import (
    advantage_metrics,
    aggregate,
    decoupled_is_weights,
    decoupled_weights_and_capped,
    gae_advantages,
    kl_estimate,
    masked_sum,
    masked_whiten,
    mismatch_metrics,
    policy_loss_terms,
    rollout_correction,
    value_loss,
)
from exactrl.config.algorithm import AlgorithmConfig
from exactrl.distributed.env import DistContext
from exactrl.model.moe import collect_router_outputs, has_experts
from exactrl.model.qwen import CausalLM
from exactrl.train.batch import (
    Accumulation,
    Rollout,
    StepBatch,
    _Acc,
    _concat_batches,
    _mask,
    _pad,
    _pad_to,
    _padded_list,
    _QueuedMinibatch,
    _rows,
)
from exactrl.train.critic import ValueModel
from exactrl.train.graphs import MicrobatchGraphs, accumulate_grads
from exactrl.train.optim import MasterAdamW
from exactrl.train.packing import (
    Bucket,
    PackedBatch,
    TrainMicrobatch,
    microbatch_logprobs,
    pack_by_tokens,
    packed_microbatches,
    response_logprobs,
)
from exactrl.train.router import load_balancing_loss, router_stats, router_z_loss_sum

_T = TypeVar("_T")

# A microbatch's graph key: its bucket, whether it carries IS weights, whether the KL term is in the loss; a fourth
# element (True): an off-policy step's only update, whose importance weights the forward computes (`_policy_body`).
MicrobatchKey = tuple[Bucket, bool, bool] | tuple[Bucket, bool, bool, bool]


class MismatchError(RuntimeError):
    """Exact mode found a rollout logprob that differs from the trainer's at the sampling weights; no optimizer
    step of the step was applied. `sequences` holds (rollout index, first differing position, rollout logprobs,
    trainer logprobs) for every offending rollout of this rank."""

    def __init__(self, message: str, sequences: list[tuple[int, int, torch.Tensor, torch.Tensor]]):
        super().__init__(message)
        self.sequences = sequences


@dataclass(frozen=True)
class TrainerSettings:
    """What the trainer takes: the [algorithm] section itself (the objective: estimator, loss, clipping, KL, value
    function, rollout correction), and the settings of [train], [run] and [sampling] that only the trainer reads.
    Frozen: what moves during a run (the adaptive KL coefficient) is the trainer's state (`PolicyTrainer.kl_coef`)."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    temperature: float = (
        1.0  # sampling.temperature (1.0 for greedy): the logprobs are of logits / temperature
    )
    max_tokens_per_microbatch: int = 8192
    # FSDP2 (train.fsdp_reduce = "microbatch"): reduce-scatter after every microbatch, the shards accumulating,
    # instead of once per minibatch after the unsharded fp32 gradients accumulated.
    reduce_every_microbatch: bool = False
    grad_clip: float = 1.0
    exact: bool = True
    # Exact mode's guard: every completion token's trainer logprob at the sampling weights is compared with the
    # engine's before any optimizer step uses the batch. "abort": no update, MismatchError; "skip_step": no update,
    # counted; "warn": the update goes ahead, the mismatch is logged.
    on_mismatch: str = "abort"
    norm_constant: float | None = None  # Dr.GRPO's constant (defaults to the longest completion)
    seed: int = 0
    # Replay each microbatch's forward + loss + backward as a CUDA graph (on a CUDA device). Microbatches are
    # then padded to a few bucket shapes (`exactrl.train.packing.choose_bucket`); padding is its own sequences
    # and never reaches the loss. None for pad_microbatches: pad exactly when graphs are used.
    cuda_graphs: bool = True
    pad_microbatches: bool | None = None
    # Mixture of experts: the router's auxiliary losses (train.moe_aux_loss_coef, train.moe_z_loss_coef), added
    # to the policy loss from the router outputs of the training forward; 0 = off (the metrics are logged anyway).
    moe_aux_loss_coef: float = 0.0
    moe_z_loss_coef: float = 0.0


class PolicyTrainer:
    """Owns the optimizer(s); `step(rollouts)` does one RL update of the shared model in place."""

    def __init__(
        self,
        model: CausalLM,
        settings: TrainerSettings,
        optimizer: MasterAdamW,
        ref_model: CausalLM | None = None,
        critic: ValueModel | None = None,
        critic_optimizer: MasterAdamW | None = None,
        dist: DistContext | None = None,
    ):
        if settings.algorithm.resolved_advantage == "gae" and critic is None:
            raise ValueError("algorithm 'ppo' needs a critic (ValueModel)")
        if settings.algorithm.kl_coef > 0 and ref_model is None:
            raise ValueError("kl_coef > 0 needs a reference model")
        self.model, self.s, self.opt = model, settings, optimizer
        self.ref_model, self.critic, self.critic_opt = ref_model, critic, critic_optimizer
        self.steps_done = 0
        # The KL coefficient in force: algorithm.kl_coef, moved between steps by the adaptive controller.
        self.kl_coef = settings.algorithm.kl_coef
        # The last step's mismatch (message and offending sequences) when on_mismatch = "skip_step" dropped it:
        # the loop writes the same replay report for it as for an abort. None after a step that was not skipped.
        self.skipped_mismatch: MismatchError | None = None
        # Under torchrun every count that normalises the loss and every metric is global; on one process these
        # collectives are the identity.
        self.dist = dist or DistContext.single()
        self.moe = has_experts(model)
        if not self.moe and (settings.moe_aux_loss_coef or settings.moe_z_loss_coef):
            raise ValueError(
                f"train.moe_aux_loss_coef = {settings.moe_aux_loss_coef} and train.moe_z_loss_coef = "
                f"{settings.moe_z_loss_coef}: router losses need a mixture-of-experts model, and this one has no "
                "sparse layer; set both to 0"
            )
        # FSDP2-sharded parameters get their gradients from a plain backward (its hooks reduce-scatter them into
        # the sharded .grad), not into this trainer's persistent buffers, and its collectives are not captured in
        # graphs.
        self.sharded = any(isinstance(p, DTensor) for p in model.parameters())
        on_cuda = model.device.type == "cuda"
        # A mixture of experts groups tokens by expert with host-side counts (ops.moe_experts), which a graph
        # capture cannot hold: its microbatches run eagerly.
        graphs = settings.cuda_graphs and on_cuda and not self.sharded and not self.moe
        self.padded = graphs if settings.pad_microbatches is None else settings.pad_microbatches
        self._grads: list[torch.Tensor] = []
        self._metric_names: list[str] = []
        self._router_layers: list[int] = []  # the sparse layers of the router statistics, in their order
        self.graphs = MicrobatchGraphs(
            self._policy_body, enabled=graphs, watched=lambda: [*self.opt.params, *self._grads]
        )

    def _policy_body(
        self,
        key: MicrobatchKey,
        x: dict[str, torch.Tensor],
        accumulate: bool,
    ) -> dict[str, torch.Tensor]:
        """One microbatch: forward, policy loss (+ entropy and KL terms), backward into the persistent gradient
        buffers. Only tensors in and out, no host reads: this is what `MicrobatchGraphs` captures.
        A 4-element key: an off-policy step's only update (decoupled PPO, `_off_policy_step`), whose proximal
        logprobs are this very forward's (detached) and whose importance weights are computed here."""
        s, a = self.s, self.s.algorithm
        bucket, _, use_loss_kl = key[:3]
        # The router outputs this very forward used (nothing for a dense model); detached from the blocks before
        # the backward, whose activation-checkpointing recomputation must not record them again.
        with collect_router_outputs(self.model) as router:
            lp, ent = microbatch_logprobs(self.model, x, bucket, s.temperature)
        m = x["mask"]
        divisor, norm_constant = x["divisor"], x["norm_constant"]
        old_lp, is_weights = x["old_lp"], x.get("is_weights")
        off_policy: dict[str, torch.Tensor] = {}
        if len(key) > 3:
            old_lp = lp.detach()  # the proximal policy: the weights at the step's start, this forward's
            w, capped = decoupled_weights_and_capped(old_lp, x["behaviour_lp"], m, x["is_cap"])
            is_weights = w
            off_policy["offpolicy/is_weight/sum"] = masked_sum(w, m)
            off_policy["offpolicy/is_weight/capped/sum"] = masked_sum(capped.to(w.dtype), m)
            off_policy["offpolicy/is_weight/max"] = w.max()
        loss, pm = policy_loss_terms(
            lp,
            old_lp,
            x["adv"],
            m,
            **a.policy_loss_kwargs(),  # the loss's kind, clip range and own constants (cispo eps, sapo taus, ...)
            aggregation=a.aggregation,
            loss_divisor=divisor,
            norm_constant=norm_constant,
            is_weights=is_weights,
        )
        pm.update(off_policy)  # after the loss's metrics: the order of the step's metric vector
        ent_term = aggregate(ent, m, a.aggregation, divisor=divisor, norm_constant=norm_constant)
        total = loss - a.entropy_coef * ent_term
        pm["entropy/sum"] = masked_sum(ent.detach(), m)
        if use_loss_kl:
            kl = kl_estimate(lp, x["ref_lp"], a.kl_kind)
            # A graph input, not a constant: the adaptive KL controller changes it between steps.
            total = total + x["kl_coef"] * aggregate(
                kl, m, a.aggregation, divisor=divisor, norm_constant=norm_constant
            )
            pm["kl_ref/sum"] = masked_sum(kl.detach(), m)
        extra: dict[str, torch.Tensor] = {}
        if router.records:
            logits, ids = [r.logits for r in router.records], [r.ids for r in router.records]
            total = self._add_router_loss(total, logits, ids, x, pm)
            extra["router"] = router_stats(logits, ids, x["router_mask"], logits[0].shape[1])
            self._router_layers = [r.layer for r in router.records]
        # Exact mode's old logprobs are the engine's: count the model's tokens whose logprob here differs (bitwise),
        # those the loss leaves out (overlong filtering) included.
        pm["mismatch/sum"] = masked_sum((lp.detach() != x["old_lp"]).float(), x["guard_mask"])
        pm["total"] = total.detach()
        if self.sharded:
            total.backward()
        else:
            accumulate_grads(total, self.opt.params, self._grads, accumulate)
        self._metric_names = list(pm)
        return {
            "metrics": torch.stack([v.detach().reshape(()).to(torch.float64) for v in pm.values()]),
            "lp": lp.detach(),
            **extra,
        }

    def _add_router_loss(
        self,
        total: torch.Tensor,
        logits: list[torch.Tensor],
        ids: list[torch.Tensor],
        x: dict[str, torch.Tensor],
        pm: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """`total` plus the router terms of one microbatch (a mixture of experts), from the forward's own router
        outputs (per sparse layer: logits [T, E], ids [T, k]); their values go to `pm` whether or not they train.

        Load balancing (transformers' Switch loss, see exactrl.train.router) is a product of two means over the
        microbatch's tokens, not a sum over tokens: each microbatch's value is weighted by its share of the
        minibatch's tokens over every rank (x["router_tokens"]), as transformers computes it per forward batch.
        The z-loss is a sum over tokens divided by that global count: a mean that no split changes. Both enter the
        loss only, never a logprob: the exactness check sees the same numbers with them on."""
        s = self.s
        mask, n_all = x["router_mask"], x["router_tokens"]
        lb = load_balancing_loss(logits, ids, mask, logits[0].shape[1]) * (mask.sum() / n_all)
        z = router_z_loss_sum(logits, mask) / (len(logits) * n_all)
        pm["moe/aux_loss"], pm["moe/z_loss"] = lb.detach(), z.detach()
        # Off means absent from the graph (not a zero weight: 0 * inf would make the step non-finite).
        if s.moe_aux_loss_coef:
            total = total + s.moe_aux_loss_coef * lb
        if s.moe_z_loss_coef:
            total = total + s.moe_z_loss_coef * z
        return total

    # -- forward pieces ----------------------------------------------------------------------------------
    def _rollout_batches(self, rollouts: list[Rollout]) -> Iterator[tuple[list[int], PackedBatch]]:
        seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
        plens = [len(r.prompt_ids) for r in rollouts]
        return packed_microbatches(seqs, plens, self.s.max_tokens_per_microbatch, self.model.device)

    def _even_batches(self, rollouts: list[Rollout]) -> Iterator[tuple[list[int], PackedBatch]]:
        """`_rollout_batches`, then empty-index padding batches until every rank has run as many forwards as
        the rank with the most (a sharded model all-gathers in every forward: the counts must agree)."""
        batches = list(self._rollout_batches(rollouts))
        extra = int(self.dist.max(len(batches))) - len(batches)  # agreed before any forward runs
        yield from batches
        for _ in range(extra):
            yield [], PackedBatch.build([[0, 0]], [1], self.model.device)

    @torch.no_grad()
    def _score(self, model: CausalLM, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Per-sequence completion logprobs without grad (old or reference policy)."""
        out: list[torch.Tensor] = []
        for mb, pb in self._even_batches(rollouts):
            lp, _, sidx = response_logprobs(model, pb, self.s.temperature)
            out += [lp[sidx == j].float().cpu() for j in range(len(mb))]
        return out

    @torch.no_grad()
    def _values(self, rollouts: list[Rollout]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        critic = _required(self.critic, "the critic (GAE advantages)")
        for mb, pb in self._even_batches(rollouts):
            v = critic(pb)
            out += [v[(pb.seq_index == j) & pb.response_mask].cpu() for j in range(len(mb))]
        return out

    # -- the step ----------------------------------------------------------------------------------------
    def step(self, rollouts: list[Rollout], *, off_policy_cap: float | None = None) -> dict[str, float]:
        """One RL update: prepare the step's tensors, check exactness, queue every minibatch's update, then read
        the results. In exact mode raises MismatchError (on_mismatch "abort") with no update applied.

        off_policy_cap: the batch may have been sampled by older weights (algorithm.max_off_policy_steps >= 1; the
        loop's guard has already checked its rollout logprobs against those behaviour weights, so the checks
        here, which compare against the current weights, are off). The loss is decoupled PPO: the ratio against
        the current policy (one no-grad forward over the batch) and `decoupled_is_weights` capped at this value."""
        self.skipped_mismatch = None
        batch = self.prepare(rollouts)
        if off_policy_cap is not None:
            return self._off_policy_step(batch, rollouts, off_policy_cap)
        if not self._grads and not self.sharded:  # the graphs add into these buffers in place
            self._grads = self.opt.persistent_grads(self.opt.params)
        plan = list(self.minibatch_plan(len(rollouts)))
        # Exact mode checks every completion token at the sampling weights before an update uses it. With one
        # update per step the training forward is at those weights: it checks for free, and a mismatch skips the
        # update on the device (no host wait). With several, later minibatches run at updated weights: one
        # no-grad forward over the step scores every token first, and the verdict is known before any update.
        guard = self.s.exact and self.s.on_mismatch != "warn"
        single_update = len(plan) <= 1
        if single_update and self.s.exact and not self.dist.sum(float(batch.full_mask.sum())):
            # No loss token anywhere (overlong filtering cut every sample): no minibatch runs a forward, so the
            # check that rides on it would not happen; the scoring forward checks every token instead.
            single_update = False
        if self.s.exact and not single_update:
            self._prescore(batch, rollouts)
            if guard and batch.mismatched:
                self.steps_done += 1
                return self._refuse(batch, rollouts, {"optimizer_steps": 0.0})
        acc = _Acc()
        pending = []  # per minibatch: its device-side results, read after the last one is queued
        for epoch, mb_i, mb_idx in plan:
            check = single_update and epoch == 0 and mb_i == 0
            queued = self.queue_minibatch(batch, mb_idx, check_mismatch=check, acc=acc, gate=guard and check)
            if queued is not None:
                pending.append(queued)
        self.steps_done += 1
        out = self.read_results(batch, pending, acc)
        if guard and batch.mismatched:
            return self._refuse(batch, rollouts, out)
        return out

    # Off-policy with one update per step: the proximal logprobs come from the training forward itself (no scoring
    # pass). False: always a separate no-grad scoring forward (the same bits; tests compare the two).
    fuse_proximal: bool = True

    def _off_policy_step(self, b: StepBatch, rollouts: list[Rollout], cap: float) -> dict[str, float]:
        """Decoupled PPO on a batch the loop's guard checked against its behaviour weights: old = the proximal
        policy (the current weights at the step's start), importance weights pi_prox / pi_behav capped. With one
        update per step the training forward is at those weights: the weights are computed inside it. With
        several, later minibatches run at updated weights: one no-grad forward scores the batch first."""
        if not self.s.exact or self.s.algorithm.rollout_correction:
            raise ValueError("off-policy steps need exact mode without rollout_correction")
        if not self._grads and not self.sharded:
            self._grads = self.opt.persistent_grads(self.opt.params)
        plan = list(self.minibatch_plan(len(rollouts)))
        if len(plan) <= 1 and self.fuse_proximal:
            b.proximal_cap = cap
        else:
            b.old_lp = _padded_list(self._score(self.model, rollouts), b.L, "cpu")
            b.weights, wm = decoupled_is_weights(b.old_lp, b.rollout_lp, b.full_mask, cap)
            b.metrics.update(wm)
        acc = _Acc()
        pending = []
        for _, _, mb_idx in plan:
            queued = self.queue_minibatch(b, mb_idx, check_mismatch=False, acc=acc)
            if queued is not None:
                pending.append(queued)
        self.steps_done += 1
        return self.read_results(b, pending, acc)

    def _prescore(self, b: StepBatch, rollouts: list[Rollout]) -> None:
        """Every completion token's trainer logprob at the current (sampling) weights, compared with the
        engine's: the mismatch metrics of the step, over every rank."""
        trainer_lp = _padded_list(self._score(self.model, rollouts), b.L, "cpu")
        b.trainer_lp = trainer_lp
        mask = b.token_mask
        b.metrics.update(mismatch_metrics(*self.dist.gather_rows(b.rollout_lp, trainer_lp, mask)))
        b.mismatched = b.metrics["mismatch/num_mismatched_tokens"] > 0

    def _refuse(self, b: StepBatch, rollouts: list[Rollout], out: dict[str, float]) -> dict[str, float]:
        """A mismatch in exact mode: no update was applied. skip_step: say so in the metrics and keep the mismatch
        (`skipped_mismatch`); abort: raise it."""
        out.update(b.metrics)
        out["mismatch/step_skipped"] = 1.0
        out["optimizer_steps"] = 0.0
        seqs = self._offending(b)
        n_bad = int(out.get("mismatch/num_mismatched_tokens", 0))
        n_all = int(out.get("mismatch/num_tokens", 0))
        head = (
            f"step {self.steps_done}: {n_bad} of {n_all} rollout logprobs differ from the trainer's at the sampling "
            f"weights (run.on_mismatch = '{self.s.on_mismatch}'); no optimizer step was applied"
        )
        first = None
        if seqs:
            i, p, r_lp, t_lp = seqs[0]
            ro = rollouts[i]
            who = f"rollout {i}" + (
                f" (request {ro.request_id}, sample {ro.sample_index})" if ro.request_id is not None else ""
            )
            first = (
                f"{who}, completion position {p}, token id {ro.completion_ids[p]}: engine "
                f"{float(r_lp[p]).hex()} ({float(r_lp[p]):.9g}), trainer {float(t_lp[p]).hex()} ({float(t_lp[p]):.9g})"
            )
        # The same line on every rank, whichever fails first (a collective: the mismatch count is global, so every
        # rank is here): the first rank with a differing token names it.
        firsts = self.dist.all_gather_object(first)
        bad = [r for r, f in enumerate(firsts) if f is not None]
        if bad and self.dist.distributed:
            ranks = ", ".join(str(r) for r in bad)
            head += f"; first on rank {bad[0]} (ranks with a differing token: {ranks}): {firsts[bad[0]]}"
        elif bad:
            head += f"; first: {firsts[bad[0]]}"
        if self.s.on_mismatch == "skip_step":
            self.skipped_mismatch = MismatchError(head, seqs)
            return out
        raise MismatchError(head, seqs)

    @staticmethod
    def _offending(b: StepBatch) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(rollout index, first differing position, rollout logprobs, trainer logprobs) of this rank's
        offending rollouts, from the checked trainer logprobs."""
        if b.trainer_lp is None:
            return []
        out = []
        for i, n in enumerate(b.lengths):
            r, t = b.rollout_lp[i, :n], b.trainer_lp[i, :n]
            diff = ((r != t) & b.token_mask[i, :n]).nonzero()
            if diff.numel():
                out.append((i, int(diff[0, 0]), r.clone(), t.clone()))
        return out

    # -- one step fed microbatch by microbatch (algorithm.overlap = "tail", exactrl/train/overlap.py) ----------
    def accumulation_refusal(self) -> str | None:
        """Why this trainer cannot take a step fed as rollouts arrive (None: it can). Such a step makes one update
        at the weights that sampled the batch, with every loss term a sum over rollouts, and no statistic of the
        whole batch before the first backward."""
        s, a = self.s, self.s.algorithm
        if not s.exact:
            return "it needs exact mode (fast mode recomputes and corrects the old logprobs over the whole batch)"
        if a.ppo_epochs != 1 or a.minibatches_per_rollout != 1:
            return (
                f"it makes one update per step (ppo_epochs = {a.ppo_epochs}, minibatches = {a.minibatches_per_rollout}: later "
                "updates would run at weights the rest of the batch was not sampled from)"
            )
        if self.critic is not None or a.resolved_advantage == "gae":
            return "GAE needs the critic's values and advantages whitened over the whole batch"
        if a.rollout_correction:
            return f"rollout_correction {a.rollout_correction!r} is fast mode's"
        if self.sharded:
            return "it runs on one process (the sharded path reduces gradients per minibatch)"
        if self.moe:
            # The router outputs are collected through the model object, which the engine runs at the same time.
            return "a mixture of experts' router statistics would collect the engine's forwards too"
        if a.aggregation == "seq-mean-token-sum-norm" and not s.norm_constant:
            return "seq-mean-token-sum-norm needs a fixed norm_constant (its default is the batch's longest completion)"
        return None

    def begin_accumulation(self) -> Accumulation:
        """Start a step whose rollouts come in pieces (`accumulate`), closed by `finish_accumulation`."""
        why = self.accumulation_refusal()
        if why is not None:
            raise ValueError(f"a training step fed as rollouts arrive: {why}")
        self.skipped_mismatch = None
        if not self._grads:  # the graphs add into these buffers in place
            self._grads = self.opt.persistent_grads(self.opt.params)
        return Accumulation()

    def accumulate(self, acc: Accumulation, rollouts: list[Rollout]) -> None:
        """Queue forward, loss and backward of `rollouts` (packed by the token budget, in order) into the gradient
        buffers; nothing is read back and no weight changes. The loss enters with a divisor of 1 (its numerator, a
        sum over tokens or sequences): the whole batch's count is not known yet; `finish_accumulation` divides the
        summed gradients by it once."""
        s = self.s
        b = self.prepare(rollouts)  # exact mode: old = the recorded logprobs; KL: the reference's, for these
        offset = len(acc.rollouts)
        for micro in pack_by_tokens([len(q) - 1 for q in b.seqs], s.max_tokens_per_microbatch):
            lp, m, vec = self._policy_microbatch(b, micro, 1, acc=acc.acc)
            acc.done.append(([offset + i for i in micro], m, vec, lp[: len(micro)].clone()))
        acc.batches.append(b)
        acc.rollouts += rollouts

    def finish_accumulation(self, acc: Accumulation) -> dict[str, float]:
        """Divide the summed gradients by the batch's divisor, take the one optimizer step (skipped on the device
        when a loss is not finite or, exact mode's guard, when any token's logprob differed from the recorded
        one), and read the results. Raises MismatchError (on_mismatch "abort") with no update applied.

        Bits: the synchronous step divides each microbatch's loss by the divisor before its backward; here the
        unscaled gradients are summed and divided once, so the gradient agrees with it to float rounding, not
        bitwise (its microbatches differ too: they follow the order rollouts arrived in)."""
        s, a = self.s, self.s.algorithm
        if not acc.rollouts:
            raise ValueError("a training step needs at least one rollout")
        b = _concat_batches(acc.batches)
        divisor = int(b.full_mask.sum()) if a.aggregation == "token-mean" else len(acc.rollouts)
        divisor = max(1, divisor)  # no loss token: the gradients are zero either way
        if self._grads:
            torch._foreach_div_(self._grads, float(divisor))
        vecs = torch.stack([d[2] for d in acc.done])
        bad = ~torch.isfinite(vecs[:, self._metric_names.index("total")]).all()
        guard = s.on_mismatch != "warn"
        if guard:
            bad = bad | (vecs[:, self._metric_names.index("mismatch/sum")] > 0).any()
        norm = self.opt.clip_and_step_async(s.grad_clip, skip=bad)
        acc.acc.num_minibatches = 1
        queued = _QueuedMinibatch(acc.done, vecs, norm, None, True, 1, guard)
        self.steps_done += 1
        out = self.read_results(b, [queued], acc.acc)
        # The loss shares came back as numerators (divisor 1): the batch's mean, as the synchronous step reports.
        if "pg_loss" in out:
            out["pg_loss"] /= divisor
        if guard and b.mismatched:
            return self._refuse(b, acc.rollouts, out)
        return out

    def abandon_accumulation(self, acc: Accumulation) -> None:
        """Drop a step fed in part (generation failed under it): the gradient buffers go back to zero."""
        acc.done.clear()
        self.opt.zero_grad()

    def prepare(self, rollouts: list[Rollout]) -> StepBatch:
        """Padded [N, L] step tensors: mask, rollout / reference / old logprobs, IS weights, advantages."""
        s, a = self.s, self.s.algorithm
        if not rollouts:
            raise ValueError("a training step needs at least one rollout")
        lengths = [len(r.completion_ids) for r in rollouts]
        if min(lengths) < 1:
            raise ValueError("every rollout needs at least one completion token")
        L = max(lengths)
        token_mask = _mask(lengths, "cpu")
        for i, r in enumerate(rollouts):
            if r.loss_mask is not None:
                if len(r.loss_mask) != lengths[i]:
                    raise ValueError(
                        f"rollout {i}: loss_mask has {len(r.loss_mask)} entries for {lengths[i]} completion tokens"
                    )
                token_mask[i, : lengths[i]] &= torch.tensor(r.loss_mask, dtype=torch.bool)
        loss_mask = token_mask.clone()
        if a.overlong_filter:
            cut = torch.tensor([r.truncated for r in rollouts], dtype=torch.bool)
            loss_mask[cut] = False
        b = StepBatch(
            lengths=lengths,
            full_mask=loss_mask,
            token_mask=token_mask,
            rollout_lp=_padded_list([r.rollout_logprobs for r in rollouts], L, "cpu"),
            seqs=[r.prompt_ids + r.completion_ids for r in rollouts],
            plens=[len(r.prompt_ids) for r in rollouts],
            norm_constant=s.norm_constant or float(L),
        )
        if a.overlong_filter:  # the step's count, over every rank
            b.metrics["overlong/filtered_samples"] = self.dist.sum(float(cut.sum()))
        if self.ref_model is not None and self.kl_coef > 0:
            b.ref_lp = _padded_list(self._score(self.ref_model, rollouts), L, "cpu")
        b.use_loss_kl = b.ref_lp is not None and not a.kl_in_reward
        self._old_logprobs(b, rollouts)
        self._advantages(b, rollouts)
        return b

    def _old_logprobs(self, b: StepBatch, rollouts: list[Rollout]) -> None:
        """In exact mode the rollout's logprobs, bit for bit (checked on the first minibatch); in fast mode a
        recompute pass, with the mismatch metrics and optional rollout correction (TIS / MIS)."""
        s, a = self.s, self.s.algorithm
        if s.exact:
            b.old_lp = b.rollout_lp
            return
        b.old_lp = _padded_list(self._score(self.model, rollouts), b.L, "cpu")
        b.metrics.update(mismatch_metrics(*self.dist.gather_rows(b.rollout_lp, b.old_lp, b.full_mask)))
        if a.rollout_correction:
            b.weights, b.full_mask, corr = rollout_correction(
                b.old_lp,
                b.rollout_lp,
                b.full_mask,
                mode=a.rollout_correction,
                threshold=a.rollout_correction_threshold,
            )
            b.metrics.update(corr)

    def _advantages(self, b: StepBatch, rollouts: list[Rollout]) -> None:
        """Sequence-level advantages from the caller, or GAE over token rewards with the critic."""
        a, L = self.s.algorithm, b.L
        if a.resolved_advantage == "gae":
            b.old_values = _padded_list(self._values(rollouts), L, "cpu")
            token_rewards = torch.zeros(len(rollouts), L)
            for i, r in enumerate(rollouts):
                token_rewards[i, b.lengths[i] - 1] = r.reward
            if b.ref_lp is not None and a.kl_in_reward:
                token_rewards = (
                    token_rewards
                    - self.kl_coef
                    * kl_estimate(_required(b.old_lp, "old_lp"), b.ref_lp, a.kl_kind)
                    * b.full_mask
                )
            b.advantages, b.returns = gae_advantages(
                token_rewards, b.old_values, b.full_mask, a.gamma, a.lam, whiten=False
            )
            if a.resolved_whiten_advantages:  # over the whole step's tokens: every rank's rows
                b.advantages = self._whiten_over_ranks(b.advantages, b.full_mask)
            # The GAE advantages the loss uses, over every rank's rollouts.
            b.metrics.update(advantage_metrics(*self.dist.gather_rows(b.advantages, b.full_mask)))
        else:
            adv = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32)[:, None].expand(-1, L)
            if b.ref_lp is not None and a.kl_in_reward:
                adv = adv - self.kl_coef * kl_estimate(_required(b.old_lp, "old_lp"), b.ref_lp, a.kl_kind)
            b.advantages = adv

    def _whiten_over_ranks(self, adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`masked_whiten` with the statistics of every rank's rows; this rank's rows of the result."""
        all_adv, all_mask = self.dist.gather_rows(adv, mask)
        counts = self.dist.all_gather_object(adv.shape[0])
        start = sum(counts[: self.dist.rank])
        return masked_whiten(all_adv, all_mask)[start : start + adv.shape[0], : adv.shape[1]]

    def minibatch_plan(self, n: int) -> Iterator[tuple[int, int, list[int]]]:
        """(epoch, minibatch index, rollout indices) of every update of the step, in order: the first epoch in
        rollout order, later ones shuffled by a generator seeded from (seed, step)."""
        s, a = self.s, self.s.algorithm
        g = torch.Generator().manual_seed(s.seed * 1_000_003 + self.steps_done)
        # Every rank takes the same number of optimizer steps: its own rollouts split in as many parts as the
        # rank with the most rollouts would make (an empty part still joins the collectives).
        parts = min(a.minibatches_per_rollout, int(self.dist.max(n)))
        for epoch in range(a.ppo_epochs):
            order = torch.arange(n) if epoch == 0 else torch.randperm(n, generator=g)
            for mb_i, mb_idx in enumerate(torch.tensor_split(order, parts)):
                if mb_idx.numel() or self.dist.distributed:
                    yield epoch, mb_i, mb_idx.tolist()

    def queue_minibatch(
        self, b: StepBatch, mb_idx: list[int], *, check_mismatch: bool, acc: _Acc, gate: bool = False
    ) -> _QueuedMinibatch | None:
        """Queue one minibatch's forward, loss and backward (microbatch by microbatch) and its optimizer step,
        without reading anything back; None when it holds no loss token. gate: a token whose logprob differs
        from the engine's makes the device skip the update (exact mode's guard)."""
        s, a = self.s, self.s.algorithm
        check_mismatch = check_mismatch and s.exact
        n_tok = int(b.full_mask[mb_idx].sum())
        # The loss is divided by the count over every rank's part of the minibatch (sharded gradients are then
        # summed, not averaged): the same objective at every world size.
        divisor = int(self.dist.sum(n_tok if a.aggregation == "token-mean" else len(mb_idx)))
        if divisor == 0:
            return None
        micros = [
            [mb_idx[j] for j in micro]
            for micro in pack_by_tokens([len(b.seqs[i]) - 1 for i in mb_idx], s.max_tokens_per_microbatch)
        ]
        # Every rank runs as many microbatches as the rank with the most; the extra ones carry no loss token.
        num_micro = int(self.dist.max(len(micros)))
        acc.num_microbatches += num_micro
        # A mixture of experts: the tokens (prompts included) of the minibatch over every rank, the router losses'
        # denominator.
        router_tokens = int(self.dist.sum(sum(len(b.seqs[i]) - 1 for i in mb_idx))) if self.moe else 0
        micros += [[]] * (num_micro - len(micros))
        # Every microbatch is queued before any result is read: one device sync per minibatch.
        done: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        for k, ids in enumerate(micros):
            # Sharded: one reduce-scatter per minibatch, or one per microbatch (train.fsdp_reduce).
            sync = s.reduce_every_microbatch or k == num_micro - 1
            _set_gradient_sync(self.model, sync)
            lp, m, metric_vec = self._policy_microbatch(b, ids, divisor, router_tokens, acc)
            done.append((ids, m, metric_vec, lp[: len(ids)].clone() if check_mismatch and ids else None))
            if self.critic is not None:
                _set_gradient_sync(self.critic, sync)
                acc.add(self._value_microbatch(b, ids, divisor), float(b.full_mask[ids].sum()))
        # The optimizer step is queued without reading anything back: a non-finite loss in any microbatch, or
        # a non-finite gradient norm, makes the device skip it. Results are read once, at the end of the step.
        vecs = torch.stack([d[2] for d in done])
        bad = ~torch.isfinite(vecs[:, self._metric_names.index("total")]).all()
        if gate:
            bad = bad | (vecs[:, self._metric_names.index("mismatch/sum")] > 0).any()
        norm = self.opt.clip_and_step_async(s.grad_clip, skip=bad)
        critic_norm = (
            self.critic_opt.clip_and_step_async(s.grad_clip, skip=bad)
            if self.critic_opt is not None
            else None
        )
        acc.num_minibatches += 1
        return _QueuedMinibatch(done, vecs, norm, critic_norm, check_mismatch, divisor, gate)

    def _policy_microbatch(
        self, b: StepBatch, ids: list[int], divisor: int, router_tokens: int = 0, acc: _Acc | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward, loss and backward of the policy on rollouts `ids` (eager or a CUDA graph replay).
        Returns (the trainer's logprobs [B, C], the loss mask [B, C], the metric vector); a mixture of experts
        adds its router statistics to `acc`."""
        s = self.s
        # No ids: a microbatch that only joins the other ranks' collectives (one 2-token sequence, no loss token).
        tm = TrainMicrobatch.build(
            [b.seqs[i] for i in ids] or [[0, 0]],
            [b.plens[i] for i in ids] or [1],
            max_tokens=s.max_tokens_per_microbatch,
            max_positions=self.model.config.max_position_embeddings,
            padded=self.padded,
        )
        B, C = tm.bucket.batch, tm.bucket.cols
        m = _rows(b.full_mask, ids, B, C)
        x = dict(
            tm.inputs,
            old_lp=_rows(_required(b.old_lp, "old_lp"), ids, B, C),
            adv=_rows(_required(b.advantages, "advantages"), ids, B, C),
            mask=m,
            guard_mask=_rows(b.token_mask, ids, B, C),
            divisor=torch.tensor(float(divisor)),
            norm_constant=torch.tensor(b.norm_constant),
        )
        if b.weights is not None:
            x["is_weights"] = _rows(b.weights, ids, B, C)
        if b.use_loss_kl:
            assert b.ref_lp is not None
            x["ref_lp"] = _rows(b.ref_lp, ids, B, C)
            x["kl_coef"] = torch.tensor(float(self.kl_coef))
        if self.moe:
            # The real tokens come first in the microbatch, padding (its own sequences) after; a microbatch with
            # no rollout (it only joins the other ranks' collectives) has none.
            real = sum(len(b.seqs[i]) - 1 for i in ids)
            x["router_mask"] = (torch.arange(tm.bucket.tokens) < real).float()
            x["router_tokens"] = torch.tensor(float(max(1, router_tokens)))
        key: MicrobatchKey = (tm.bucket, b.weights is not None, b.use_loss_kl)
        if b.proximal_cap is not None:  # decoupled PPO inside the forward (`_policy_body`)
            x["behaviour_lp"] = _rows(b.rollout_lp, ids, B, C)
            x["is_cap"] = torch.tensor(float(b.proximal_cap))
            key = (*key, True)
        out = self.graphs.run(key, x)
        if "router" in out and acc is not None:
            stats = out["router"].clone()  # a graph's output buffer is overwritten by the next replay
            acc.router = stats if acc.router is None else acc.router + stats
            acc.router_layers = self._router_layers
        return out["lp"], m, out["metrics"].clone()

    def _value_microbatch(self, b: StepBatch, ids: list[int], divisor: int) -> dict[str, float]:
        """The critic's clipped value loss on rollouts `ids`, backward into its gradients."""
        a = self.s.algorithm
        assert self.critic is not None and b.old_values is not None and b.returns is not None
        dev = self.model.device
        if not ids:  # joins the other ranks' collectives with a zero loss
            pb = PackedBatch.build([[0, 0]], [1], dev)
            (self.critic(pb).sum() * 0.0).backward()
            return {}
        pb = PackedBatch.build([b.seqs[i] for i in ids], [b.plens[i] for i in ids], dev)
        lens = [b.lengths[i] for i in ids]
        Lm = max(lens)
        v_flat = self.critic(pb)
        v = _pad(v_flat[pb.response_mask], pb.seq_index[pb.response_mask], lens)
        vl, vm = value_loss(
            v,
            b.old_values[ids, :Lm].to(dev),
            b.returns[ids, :Lm].to(dev),
            b.full_mask[ids, :Lm].to(dev),
            clip=a.value_clip,
            aggregation=a.aggregation,
            loss_divisor=divisor,
            norm_constant=b.norm_constant,
        )
        (a.vf_coef * vl).backward()
        return vm

    def read_results(self, b: StepBatch, pending: list[_QueuedMinibatch], acc: _Acc) -> dict[str, float]:
        """Read every queued minibatch's metrics back (the step's one wait for the device) and fold them."""
        a = self.s.algorithm
        metrics = b.metrics
        grad_norms, nan_skips, num_updates = [], 0, 0
        for q in pending:
            finite = True
            mm_parts = []
            for (ids, m, _, lp), vals in zip(q.done, q.vecs.tolist()):
                pm = dict(zip(self._metric_names, vals))
                pm.pop("mismatch/sum")  # the guard's device-side count; the metrics below are the host's
                total = pm.pop("total")
                if lp is not None:  # the guard compares every token, a minibatch skipped for a NaN loss's too
                    lens = [b.lengths[i] for i in ids]
                    Lm = max(lens)
                    mm_parts.append((b.rollout_lp[ids, :Lm], lp[:, :Lm].cpu(), b.token_mask[ids, :Lm]))
                if not finite or not math.isfinite(total):
                    finite = False  # the minibatch's update is skipped; its metrics stop here
                    continue
                # Metrics are per-token means whatever the aggregation (so runs compare), and `loss` is this
                # microbatch's aggregated value (its own denominator, where the gradient uses the step's).
                n_m = max(1, int(m.sum()))
                local = n_m if a.aggregation == "token-mean" else max(1, int((m.sum(-1) > 0).sum()))
                pm["entropy"] = pm.pop("entropy/sum") / n_m
                if b.use_loss_kl:
                    pm["kl_ref"] = pm.pop("kl_ref/sum") / n_m
                pm["loss"] = total * q.divisor / local
                acc.add(pm, float(m.sum()))
            if q.check_mismatch:
                r_all = torch.cat([_pad_to(p[0], b.L) for p in mm_parts] or [torch.zeros(0, b.L)])
                t_all = torch.cat([_pad_to(p[1], b.L) for p in mm_parts] or [torch.zeros(0, b.L)])
                k_all = torch.cat(
                    [_pad_to(p[2], b.L) for p in mm_parts] or [torch.zeros(0, b.L, dtype=torch.bool)]
                )
                metrics.update(mismatch_metrics(*self.dist.gather_rows(r_all, t_all, k_all)))
                b.mismatched = metrics["mismatch/num_mismatched_tokens"] > 0
                if b.mismatched:  # the checked trainer logprobs, for the report
                    b.trainer_lp = torch.zeros_like(b.rollout_lp)
                    for ids, _, _, lp in q.done:
                        if lp is not None:
                            w = min(b.L, lp.shape[1])
                            b.trainer_lp[ids, :w] = lp[:, :w].cpu()
            if q.critic_norm is not None:
                metrics["critic/grad_norm"] = float(q.critic_norm)
            value = 0.0 if q.norm is None else float(q.norm)
            if q.gated and b.mismatched:  # the guard skipped it, not a non-finite loss
                continue
            if not finite or math.isnan(value):
                nan_skips += 1
            else:
                grad_norms.append(value)
                num_updates += 1
        acc.reduce(self.dist)
        out = acc.result()
        n = out.get("num_tokens", 0.0)
        if n and "ratio/sum" in out:
            out["ratio/mean"] = out["ratio/sum"] / n
        if n and "offpolicy/is_weight/sum" in out:  # decoupled PPO's weights, computed in the forward
            out["offpolicy/is_weight/mean"] = out.pop("offpolicy/is_weight/sum") / n
            out["offpolicy/is_weight/capped_frac"] = out.pop("offpolicy/is_weight/capped/sum") / n
        out.update(metrics)
        out["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
        out["nan_skipped"] = float(nan_skips)
        out["optimizer_steps"] = float(num_updates)
        out["lr"] = float(self.opt.param_groups[0]["lr"])
        if self.opt.on_cuda:  # the optimizer's share of the step (offload's copies in and out included)
            out["perf/optimizer_s"] = self.opt.take_step_seconds()
            if self.critic_opt is not None:
                out["perf/optimizer_s"] += self.critic_opt.take_step_seconds()
        if self.graphs.enabled:
            out["perf/train_graphs"] = float(len(self.graphs))
            out["perf/train_graph_capture_s"] = self.graphs.capture_s
        return out


def _set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """FSDP2: reduce-scatter gradients in this backward only when `sync` (the minibatch's last microbatch, or
    every microbatch with train.fsdp_reduce = "microbatch"); before that they accumulate unsharded, in fp32.
    Nothing to do for an unsharded model."""
    set_sync = getattr(model, "set_requires_gradient_sync", None)
    if set_sync is not None:
        set_sync(sync)


def _required(t: _T | None, what: str) -> _T:
    """`t`, which the step has set by now (`PolicyTrainer.prepare` fills a StepBatch in order)."""
    if t is None:
        raise RuntimeError(f"PolicyTrainer: {what} is not set at this point of the step")
    return t
