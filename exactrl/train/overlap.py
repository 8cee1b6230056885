"""Train on a batch's finished groups while its tail still generates (algorithm.overlap = "tail").

A synchronous step waits for its longest completion: the last seconds of generation run a handful of sequences
on an almost idle GPU while the trainer waits. Here the engine generates the step's batch in a worker thread
(`GenerationWorker`, on a high-priority CUDA stream) and reports each prompt as soon as all its samples have
finished (`RolloutEngine.generate(on_request_done=...)`). The loop's thread scores that group (rewards, and its
advantages: GRPO-style advantages are computed within a group) and feeds the finished rollouts to the trainer as
microbatches (`PolicyTrainer.accumulate`: forward + loss + backward into the gradient buffers) while the rest of
the batch keeps generating. The optimizer step waits for the whole batch (`finish_accumulation`).

Why this stays on-policy and exact: nothing writes the weights before the optimizer step (a forward and a
backward only write activations and gradients), so every token of the batch is sampled by the same weights the
trainer's forward uses, and the guard is the usual one: each token's recorded logprob is compared with the
training forward's inside the microbatch that trains on it, and a difference skips the one optimizer step on
the device. The engine's scheduling and sampling are untouched: the rollouts are the synchronous run's, bit for
bit. The update is not bitwise the synchronous one's: its microbatches follow the order groups finished (which is
deterministic: same seed, same run), and the loss enters each backward unnormalised, the summed gradients being
divided by the batch's token (or sequence) count once at the end (`finish_accumulation` says what that does).

Host threads: both threads hold Python's GIL in turn. The engine thread releases it while it waits for each step's
tokens and must get it back quickly, or a decode step waits behind the trainer's Python; the switch interval is
lowered for the step (`GIL_SWITCH_INTERVAL_S`), and restored after.

Microbatch composition follows the finish order alone (`MicrobatchFiller`), never the timing: a microbatch is
closed when the next finished rollout would not fit the token budget, exactly as `pack_by_tokens` cuts a list.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from exactrl.engine.engine import RequestOutput, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.moe import has_experts
from exactrl.train.logging import progress_bar
from exactrl.train.offpolicy import GenerationWorker
from exactrl.train.trainer import MismatchError, PolicyTrainer, Rollout

# While a step overlaps, Python hands the GIL over after at most this long (its default is 5 ms): the engine thread,
# back from waiting for a decode step's tokens, gets it within this instead of queuing a whole interval behind the
# trainer's host work (a decode step in the tail is a few milliseconds).
GIL_SWITCH_INTERVAL_S = 5e-4
# The generation stream's CUDA priority: lower is higher. Priority orders the thread blocks waiting for an SM; it
# preempts nothing, and the trainer's persistent GEMMs hold every SM for their whole run, so on the H100 a decode
# step beside training was as slow on a high-priority stream as on a default one (benchmarks/probe_priority.py,
# docs/benchmarks.md "Twelfth session"). Kept because it costs nothing and helps against non-persistent kernels.
GENERATION_STREAM_PRIORITY = -1


class _Run(Protocol):
    """What the stage uses of the RL loop (`exactrl.train.loop.RLRun`)."""

    cfg: Any
    engine: RolloutEngine
    trainer: PolicyTrainer
    kl_ctl: Any
    out: Callable[..., Any]

    def sampling_params(self) -> SamplingParams: ...
    def score(self, step: int, examples: list, prompt_ids: list, outs: list, baseline: Any = None) -> Any: ...
    def with_advantages(self, *args: Any, **kwargs: Any) -> Any: ...
    def mismatch_report(self, step: int, rollouts: list[Rollout], err: MismatchError) -> Any: ...
    def mismatch_abort(self, step: int, sr: Any, err: MismatchError) -> None: ...


def check_supported(distributed: bool, model: torch.nn.Module) -> None:
    """What the config cannot say (exactrl.config checks the rest): one process, a dense model."""
    check_supported_config(distributed, has_experts(model))


def check_supported_config(distributed: bool, moe: bool) -> None:
    """`check_supported` before the model exists (exactrl.train.preflight: moe from the model's config)."""
    if distributed:
        raise ValueError('algorithm.overlap = "tail" runs on one process for now (not under torchrun)')
    if moe:
        raise ValueError(
            'algorithm.overlap = "tail" does not support a mixture-of-experts model: the router statistics are '
            "collected through the model object, which the engine runs at the same time"
        )


_END = object()  # the worker's last item: generation returned (or failed)


class GroupStream:
    """`generate` in a worker thread; the finished requests handed to the caller's thread one by one."""

    def __init__(self, device: torch.device | str) -> None:
        self.worker = GenerationWorker(device, priority=GENERATION_STREAM_PRIORITY)
        self._queue: queue.Queue[Any] = queue.Queue()
        self._done = threading.Event()
        self.generate_s = 0.0  # the generate call's wall time (in the worker)
        self.wait_s = 0.0  # the caller blocked on the next finished request

    @property
    def generating(self) -> bool:
        return not self._done.is_set()

    def start(
        self,
        engine: RolloutEngine,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        request_ids: list[int],
        progress: Callable[[int], object] | None = None,
    ) -> None:
        self._done.clear()
        self.generate_s = self.wait_s = 0.0

        def job() -> list[RequestOutput]:
            t0 = time.perf_counter()
            try:
                return engine.generate(
                    prompt_ids, params, request_ids, progress=progress, on_request_done=self._queue.put
                )
            finally:
                self.generate_s = time.perf_counter() - t0
                self._done.set()
                self._queue.put(_END)

        self.worker.start(job)

    def __iter__(self) -> Iterator[RequestOutput]:
        """The requests as they finish; then the generate call's own outcome (its exception, if it failed)."""
        while True:
            t0 = time.perf_counter()
            item = self._queue.get()
            self.wait_s += time.perf_counter() - t0
            if item is _END:
                break
            yield item
        self.worker.result()  # joins the thread; raises what generate raised

    def close(self) -> None:
        """Wait for a generation still running (the caller failed under it) and drop what is left."""
        self.worker.close()
        self._queue = queue.Queue()


class MicrobatchFiller:
    """Finished rollouts, in the order they arrive, cut into microbatches of at most `max_tokens` tokens (a longer
    rollout gets one of its own): `pack_by_tokens`'s rule applied online, so the cut depends on the order alone."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._current: list[Rollout] = []
        self._used = 0

    def add(self, rollouts: list[Rollout]) -> list[list[Rollout]]:
        """Take rollouts; return the microbatches they closed."""
        closed = []
        for r in rollouts:
            n = len(r.prompt_ids) + len(r.completion_ids) - 1  # the tokens the training forward runs
            if self._current and self._used + n > self.max_tokens:
                closed.append(self._current)
                self._current, self._used = [], 0
            self._current.append(r)
            self._used += n
        return closed

    def flush(self) -> list[list[Rollout]]:
        """The last, partly filled microbatch (none when empty)."""
        rest, self._current, self._used = self._current, [], 0
        return [rest] if rest else []


class TailOverlap:
    """The stage `RLRun.rl_step` runs for algorithm.overlap = "tail": rollout, score and update of one step, the
    update fed group by group while the batch's tail generates."""

    def __init__(self, run: _Run, device: torch.device | str) -> None:
        self.run = run
        self.stream = GroupStream(device)

    def step(
        self, step: int, examples: list[Any], prompt_ids: list[list[int]], index: list[int]
    ) -> tuple[Any, dict[str, float], float, float]:
        """(the step's StepRollouts, the trainer's metrics with the overlap's, generate seconds, train seconds).
        The StepRollouts are in prompt order, as the synchronous step's are."""
        run, cfg = self.run, self.run.cfg
        a = cfg.algorithm
        base = step * a.prompts_per_step
        request_ids = [base + i for i in index]
        slot = {rid: k for k, rid in enumerate(request_ids)}
        trainer = run.trainer
        trainer.s.kl_coef = run.kl_ctl.value  # as RLRun.update sets it
        bar = progress_bar(
            len(prompt_ids) * a.group_size, f"step {step + 1} generate + train", cfg.run.progress
        )
        filler = MicrobatchFiller(trainer.s.max_tokens_per_microbatch)
        groups: dict[int, Any] = {}  # prompt slot -> its scored group (StepRollouts of one group)
        refused = 0
        count = {"mb": 0, "mb_during": 0, "tok": 0, "tok_during": 0}
        times = {"score": 0.0, "train": 0.0}

        def feed(mb: list[Rollout]) -> None:
            during = self.stream.generating  # read before: the microbatch is queued while generation runs
            t0 = time.perf_counter()
            trainer.accumulate(acc, mb)
            times["train"] += time.perf_counter() - t0
            n = sum(len(r.completion_ids) for r in mb)
            count["mb"] += 1
            count["tok"] += n
            if during:
                count["mb_during"] += 1
                count["tok_during"] += n

        switch = sys.getswitchinterval()
        acc = trainer.begin_accumulation()
        try:
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            self.stream.start(run.engine, prompt_ids, run.sampling_params(), request_ids, bar.update)
            for out in self.stream:
                k = slot[out.request_id]
                if out.error is not None or len(out.samples) != a.group_size:
                    refused += 1  # as RLRun.score skips it: the others train
                    run.out(f"step {step + 1}: prompt skipped by the engine: {out.error}")
                    continue
                t0 = time.perf_counter()
                groups[k] = run.score(step, [examples[k]], [prompt_ids[k]], [out])
                times["score"] += time.perf_counter() - t0
                for mb in filler.add(groups[k].rollouts):
                    feed(mb)
            t_generated = time.perf_counter()
            for mb in filler.flush():
                feed(mb)
            if not groups:
                raise RuntimeError(
                    f"step {step + 1}: the engine refused every prompt of the step; check engine.num_kv_blocks / "
                    "engine.max_model_len against the prompt lengths"
                )
            sr = self.assemble(groups, refused)
            t0 = time.perf_counter()
            try:
                m = trainer.finish_accumulation(acc)
            except MismatchError as err:  # abort: no update applied; the report names rollouts in feed order
                run.mismatch_abort(step, dataclasses.replace(sr, rollouts=acc.rollouts), err)
                raise
            times["train"] += time.perf_counter() - t0
            t_end = time.perf_counter()
        except BaseException:
            self.stream.close()
            trainer.abandon_accumulation(acc)
            raise
        finally:
            sys.setswitchinterval(switch)
            bar.close()
        skipped = trainer.skipped_mismatch
        if skipped is not None:  # skip_step: the same evidence RLRun.update leaves
            where = run.mismatch_report(step, acc.rollouts, skipped)
            if where is not None:
                run.out(f"step {step + 1} skipped: {skipped}\n   replay it: exactrl parity --replay {where}")
        m.update(
            {
                "overlap/microbatches": float(count["mb"]),
                "overlap/microbatches_during_generation": float(count["mb_during"]),
                "overlap/tokens_during_generation": float(count["tok_during"]),
                "overlap/share_during_generation": count["tok_during"] / max(1, count["tok"]),
                "perf/wait_s": self.stream.wait_s,  # the loop's thread waiting for the next finished group
                "perf/score_s": times["score"],
                # From the last finished sequence to the update applied: the training that did not overlap.
                "perf/train_after_generate_s": t_end - t_generated,
            }
        )
        return sr, m, self.stream.generate_s, times["train"]

    def assemble(self, groups: dict[int, Any], refused: int) -> Any:
        """The step's StepRollouts in prompt order, built by the loop's own `with_advantages` over the whole batch,
        as the synchronous step builds them. The advantages the groups were trained with must be those bits: an
        estimator that looked past its group would differ here (config refuses those; this says so if one slips)."""
        run = self.run
        order = sorted(groups)
        parts = [groups[k] for k in order]
        rollouts = [ro for g in parts for ro in g.rollouts]
        trained = torch.tensor([ro.advantage for ro in rollouts], dtype=torch.float32)
        per_function = {fn: [v for g in parts for v in g.per_function[fn]] for fn in parts[0].per_function}
        sr = run.with_advantages(
            rollouts,
            [ro.reward for ro in rollouts],
            per_function,
            sum(g.reward_errors for g in parts),
            [c for g in parts for c in g.completions],
            [x for g in parts for x in g.answers],
            None,
            refused=refused,
        )
        if not torch.equal(sr.advantages, trained):
            raise RuntimeError(
                f"algorithm.advantage {run.cfg.algorithm.resolved_advantage!r}: the advantages computed per group "
                'differ from the whole batch\'s; algorithm.overlap = "tail" needs an estimator local to each group'
            )
        for g in parts:
            for key, n in g.reward_failures.items():
                sr.reward_failures[key] = sr.reward_failures.get(key, 0) + n
        return sr
