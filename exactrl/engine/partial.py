"""Partial generation: an engine call that may stop before every sample has finished, and samples carried over.

`PartialGeneration` is one engine call, stepped by the caller (the same `_Generation.step()` as
`RolloutEngine.generate`), which decides when to stop from the samples finished so far (`step` hands them out).
`cut()` then ends the call: the step in flight is read back, and every sample that has not finished is exported
as a `PartialSample` (prompt, tokens generated so far, their recorded logprobs, its length limit). Nothing of its
KV is kept: the scheduler and block manager are the call's own and go with it.

A later call takes those samples back (`resumed`): each is readmitted like a preempted sequence
(`Scheduler.readmit`): its admission prefills prompt + generated tokens under the weights the engine holds at
that call, and samples on from there. That is what keeps a partial rollout exact when the engine's weights
changed in between: KV computed under the old weights is never extended by tokens sampled under the new ones,
so every token's recorded logprob is the forward of ONE weight version over the sequence before it (the version
that sampled it), which the trainer's forward of that version reproduces bit for bit.

What a resumed sample draws is what it would have drawn in one uninterrupted call under the same weights: the
sampling noise is keyed by (seed, request id, sample index, position), with no stream state to carry, and the
kernels give the same bits whether a prefix was decoded token by token or prefilled in chunks. So the request id
and sample index travel with the sample; the position is its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exactrl.engine.engine import RequestOutput, RolloutEngine, _Generation
from exactrl.engine.sampler import SamplingParams
from exactrl.engine.sequence import Sequence


@dataclass
class PartialSample:
    """One sample of a request: finished (finish_reason set) or cut before it finished (finish_reason None).

    rollout_logprobs: one per completion token, the engine's recorded logprob (Python floats: float32 values,
    exact). max_tokens: the limit of the whole completion (not what is left of it)."""

    request_id: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    max_tokens: int = 1
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class PartialGeneration:
    """New prompts (params.n samples each, forked after one shared prefill as in `generate`) and resumed samples in
    one engine call, stepped by the caller.

    `errors[request_id]` names a new prompt the engine refused (empty, too long); its samples never run."""

    def __init__(
        self,
        engine: RolloutEngine,
        prompts: list[list[int]],
        request_ids: list[int],
        params: SamplingParams,
        resumed: list[PartialSample] = (),  # type: ignore[assignment]
    ) -> None:
        params.validate()
        self.engine = engine
        resumed = list(resumed)
        for s in resumed:
            if s.finished:
                raise ValueError(
                    f"request {s.request_id} sample {s.sample_index} has finished; nothing to resume"
                )
        ids = engine._check_request_ids(prompts, request_ids) if prompts else []
        clash = set(ids) & {s.request_id for s in resumed}
        if clash:
            raise ValueError(f"request ids {sorted(clash)[:5]} are both new and resumed in one call")
        outputs = [RequestOutput(rid, list(p)) for rid, p in zip(ids, prompts)]
        valid = engine._admissible(prompts, outputs) if prompts else []
        self.errors: dict[int, str] = {o.request_id: o.error for o in outputs if o.error is not None}
        # Size the KV cache for everything in the call (the runner grows, never shrinks, so `_start` keeps it).
        bs = engine.config.block_size
        need = sum(len(s.prompt_ids) + s.max_tokens + bs for s in resumed)
        need += sum(len(prompts[i]) + params.n * (params.max_tokens + bs) for i in valid)
        engine._ensure_runner(need)
        # New prompts through the engine's own admission (so a subclass's per-sample plans apply to them).
        self._gen: _Generation = engine._start(prompts, ids, valid, params, None, extra_rows=len(resumed))
        self.params = params
        self._readmit(resumed)

    def _readmit(self, resumed: list[PartialSample]) -> None:
        sched = self._gen.sched
        stop = list(self.params.stop_token_ids)
        groups: dict[int, list[PartialSample]] = {}
        for s in resumed:
            groups.setdefault(s.request_id, []).append(s)
        seqs: list[Sequence] = []
        for rid, group in groups.items():
            group.sort(key=lambda s: s.sample_index)
            fresh = [s.sample_index for s in group] == list(range(len(group))) and not any(
                s.completion_ids for s in group
            )
            if fresh and len(group) > 1:
                # A whole group that never started (cut while waiting): one parent, forked after one prefill.
                seq = Sequence(
                    sched.new_seq_id(),
                    rid,
                    group[0].prompt_ids,
                    max_tokens=group[0].max_tokens,
                    num_samples=len(group),
                    stop_token_ids=stop,
                )
                seq.set_max_tokens_per_sample([s.max_tokens for s in group])
                seqs.append(seq)
                continue
            for s in group:
                seq = Sequence(
                    sched.new_seq_id(),
                    rid,
                    s.prompt_ids,
                    max_tokens=s.max_tokens,
                    sample_index=s.sample_index,
                    stop_token_ids=stop,
                )
                seq.token_ids.extend(int(t) for t in s.completion_ids)
                seq.rollout_logprobs = [float(x) for x in s.rollout_logprobs]
                seqs.append(seq)
        # Resumed samples go ahead of the new prompts (the front of the queue), in the order given.
        for seq in reversed(seqs):
            if seq.num_completion_tokens:
                sched.readmit(seq)
            else:
                sched.add(seq)  # at the back (or finished at once: it can never fit): to the front, as above
                if sched.waiting and sched.waiting[-1] is seq:
                    sched.waiting.appendleft(sched.waiting.pop())

    def step(self) -> tuple[bool, list[PartialSample]]:
        """One engine step: (whether anything is left to run or in flight, the samples finished in it)."""
        more = self._gen.step()
        done, self._gen.finished = self._gen.finished, []
        return more, [self._export(s) for s in done]

    def cut(self) -> list[PartialSample]:
        """End the call: read back the step in flight, and return every sample finished since the last `step`
        and every unfinished one (finish_reason None), with the tokens and logprobs it has so far. A group parent
        not yet forked (its prompt still prefilling, or waiting) gives its n samples with no tokens."""
        gen = self._gen
        if gen.pending is not None:  # committed, its tokens still on the device: they are real samples
            gen.settle(gen.pending)
            gen.pending = None
        sched = gen.sched
        out = [self._export(s) for s in gen.finished + sched.take_finished()]
        gen.finished = []
        for seq in [*sched.running, *sched.waiting]:
            if seq.num_samples > 1:  # an unforked group parent: n samples, none started
                limits = seq.max_tokens_per_sample or (seq.max_tokens,) * seq.num_samples
                out += [
                    PartialSample(seq.request_id, j, seq.prompt_token_ids, max_tokens=limits[j])
                    for j in range(seq.num_samples)
                ]
            else:
                out.append(self._export(seq))
        gen.fold_stats()
        sched.running, sched.waiting = [], type(sched.waiting)()
        return out

    @staticmethod
    def _export(seq: Sequence) -> PartialSample:
        reason = seq.finish_reason if seq.is_finished else None
        if reason is None and seq.has_pending_token:  # cut() reads the step in flight back first
            raise RuntimeError(
                f"sequence {seq.seq_id} cannot be exported with a token still on the device: {seq}"
            )
        return PartialSample(
            seq.request_id,
            seq.sample_index,
            seq.prompt_token_ids,
            seq.completion_token_ids,
            list(seq.rollout_logprobs),
            seq.max_tokens,
            reason,
        )


@dataclass
class CutRule:
    """When a partial generation stops: after the first engine step at which at least `need` requests are complete
    (every sample finished, none refused) and every request in `wait_for` is complete or refused.

    left: for every request in flight (new and resumed, and those already complete: 0), how many of its samples
    are still to finish when the call starts. A count, never the clock, so the same call cuts at the same step."""

    need: int
    left: dict[int, int]
    wait_for: list[int] = field(default_factory=list)


@dataclass
class CutResult:
    """What a generation cut by a `CutRule` returns: every sample it ran (finished or cut, in the order they left
    the engine), the new prompts it refused (request id -> reason) and the engine steps it ran."""

    samples: list[PartialSample]
    errors: dict[int, str]
    steps: int


def generate_until_cut(
    engine: RolloutEngine,
    prompts: list[list[int]],
    request_ids: list[int],
    params: SamplingParams,
    resumed: list[PartialSample],
    rule: CutRule,
) -> CutResult:
    """New prompts and resumed samples in one `PartialGeneration`, stepped until `rule` says stop (or nothing is
    left), then cut. A request whose sample finished with an error, or a new prompt the engine refused, counts as
    refused: never complete, and no longer waited for."""
    gen = PartialGeneration(engine, prompts, request_ids, params, resumed)
    left = dict(rule.left)
    refused = set(gen.errors)
    complete = sum(n == 0 for r, n in left.items() if r not in refused)
    samples: list[PartialSample] = []

    def count(finished: list[PartialSample]) -> None:
        nonlocal complete
        samples.extend(finished)
        for ps in finished:
            if ps.finish_reason is not None and ps.finish_reason.startswith("error"):
                refused.add(ps.request_id)
            if ps.finished and ps.request_id not in refused:
                left[ps.request_id] -= 1
                complete += left[ps.request_id] == 0

    def cut_now() -> bool:
        settled = all(left[r] == 0 or r in refused for r in rule.wait_for)
        return complete >= rule.need and settled

    steps, more = 0, True
    while more and not cut_now():
        more, finished = gen.step()
        steps += 1
        count(finished)
    samples.extend(gen.cut())
    return CutResult(samples, dict(gen.errors), steps)
