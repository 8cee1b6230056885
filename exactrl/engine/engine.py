"""`RolloutEngine`: generate with the policy the trainer updates, recording exact rollout logprobs.

One step = schedule (scheduler.py) -> copy-on-write block copies -> one flat forward of the shared model over
the paged KV cache (runner.py) -> LM head at the sampling temperature -> Gumbel-max sampling keyed on
(seed, request, sample, position) (sampler.py) -> postprocess. The logprob recorded for a sampled token comes
from the same `logits` the trainer's `logprobs` op normalises, with the same row-wise log-softmax, so it is
bitwise equal to what the trainer computes in exact mode.

Decode steps are pipelined: step t+1 is scheduled and launched while step t runs, with step t's tokens still on
the device (the scheduler's commit/resolve split, runner.fetch), and step t is read back and resolved while
step t+1 runs. The host's bookkeeping then hides behind the GPU instead of sitting between two steps. What is
sampled does not change: the noise is keyed by (seed, request, sample, position), and no kernel depends on
what else is in the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from exactrl.config import EngineConfig
from exactrl.engine.block_manager import BlockManager
from exactrl.engine.runner import DecodeRow, ModelRunner, StepEntry, StepOutput, auto_num_blocks
from exactrl.engine.sampler import SamplingParams, find_stop_string, noise_keys, sample
from exactrl.engine.scheduler import SampleRow, ScheduledBatch, Scheduler
from exactrl.engine.sequence import Sequence
from exactrl.model.qwen import CausalLM
from exactrl.ops import torch_determinism_off
from exactrl.ops.batch import upload_int64
from exactrl.ops.triton.common import pdl_launches


@dataclass
class Sample:
    """One completion. rollout_logprobs: [len(token_ids)] fp32, the policy's logprob of each sampled token at
    the sampling temperature (at 1.0 for greedy)."""

    token_ids: list[int]
    rollout_logprobs: torch.Tensor
    finish_reason: str
    text: str | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    samples: list[Sample] = field(default_factory=list)
    error: str | None = None


def default_decode_mode(model: Any, cuda_graphs: bool) -> str:
    """How an engine decodes `model` unless told (`RolloutEngine.decode_mode`): CUDA graphs on a GPU when
    `cuda_graphs`, else eagerly. A model whose decode a graph cannot hold (`graph_capturable` False) decodes
    eagerly: the same bits, launched by the host."""
    capturable = getattr(model, "graph_capturable", True)
    return "graph" if cuda_graphs and capturable and model.device.type == "cuda" else "eager"


class RolloutEngine:
    """Generates from `model` (shared with the trainer: no copies, no files)."""

    def __init__(self, model: CausalLM, config: EngineConfig | None = None, tokenizer=None):
        self.model = model
        # The engine's own copy: sizing its cache (exactrl/train/phases.py sets num_kv_blocks) never writes into the
        # config it was given, often the run's `cfg.engine`.
        self.config = replace(config) if config is not None else EngineConfig()
        self.tokenizer = tokenizer
        self.runner: ModelRunner | None = None
        # How pure decode steps run (runner.DECODE_MODES); None: "graph" on CUDA when config.cuda_graphs, else
        # "eager". Tests set "static" to run the graph path's padded static buffers eagerly on the CPU.
        self.decode_mode: str | None = None
        self.stats: dict[str, float] = {}
        self.reset_stats()
        # Off (None) unless a caller sets a list: each engine step then appends (step index, wall time, running
        # sequences, waiting sequences) after scheduling, e.g. for `exactrl bench rl`'s concurrency plot. Host-side
        # counts and a clock read only: no device sync.
        self.trace: list[tuple[int, float, int, int]] | None = None
        # The ranks that share this engine (tensor or expert parallel) each size an unset KV cache from their own
        # free memory; they must hold the same number of blocks, or their schedulers (which preempt when blocks
        # run out) would part ways. None: this engine alone; else a function every rank of the group calls with its
        # own figure, returning the one they agree on (the smallest: exactrl/distributed/shared_engine.py).
        self.agree_blocks: Callable[[int], int] | None = None

    def reset_stats(self) -> None:
        self.stats = {
            "steps": 0,
            "preemptions": 0,
            "prefill_s": 0.0,
            "decode_s": 0.0,
            "cuda_graph_steps": 0,
            "static_decode_steps": 0,
            "ahead_steps": 0,  # launched before the previous step was read back
            "prefix_hit_blocks": 0,  # the block managers' bookkeeping, summed over calls
            "fork_shared_blocks": 0,
            "cow_copies": 0,
        }

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) this engine runs: config.max_model_len, or the model's
        max_position_embeddings when that is smaller (its RoPE table ends there)."""
        return min(self.config.max_model_len, self.model.config.max_position_embeddings)

    def _length_limit(self) -> str:
        """The limit `max_model_len` is, in words, for a refusal."""
        positions = self.model.config.max_position_embeddings
        if positions < self.config.max_model_len:
            return f"the model's max_position_embeddings ({positions})"
        return f"max_model_len ({self.config.max_model_len})"

    def _ensure_runner(self, tokens_needed: int) -> ModelRunner:
        """The KV cache for a call: a fixed size when configured, else sized for the call's worst case (within
        the memory budget) and grown, never shrunk, when a later call needs more."""
        cfg = self.config
        r = self.runner
        mode = self.decode_mode or default_decode_mode(self.model, cfg.cuda_graphs)
        if r is not None and (
            r.kv_device != self.model.device
            or r.kv_dtype != self.model.dtype
            or r.decode_mode != mode
            or r.max_num_seqs != cfg.max_num_seqs
            or r.max_model_len != self.max_model_len
        ):
            r = None  # the model moved, changed dtype or the engine's shape changed: rebuild
        if cfg.num_kv_blocks:
            n = cfg.num_kv_blocks
        else:
            # A larger cache may take the memory of the one it would replace (released first, below, if it grows).
            held = r.kv_cache_bytes if r is not None else 0
            n = auto_num_blocks(self.model, cfg.block_size, cfg.kv_memory_fraction, tokens_needed, held)
            if self.agree_blocks is not None:
                n = self.agree_blocks(n)
            if r is not None:
                n = max(n, r.num_blocks)
        if r is None or r.num_blocks != n:
            old, r, self.runner = self.runner, None, None
            # Its cache and graphs go before the new cache is allocated (they form a cycle).
            if old is not None:
                old.release_graphs()
                old.release_kv()
            del old
            r = ModelRunner(
                self.model,
                n,
                cfg.block_size,
                max_num_seqs=cfg.max_num_seqs,
                max_model_len=cfg.max_model_len,
                decode_mode=mode,
            )
        r.allocate_kv()  # a cache released between phases comes back (no-op when allocated)
        self.runner = r
        return r

    def release_kv(self) -> int:
        """Free the KV cache's device memory until the next `generate` (the runner, its size and its decode
        graphs stay); returns the bytes freed. Nothing carries over between calls anyway: each starts with a
        fresh block manager."""
        return 0 if self.runner is None else self.runner.release_kv()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_ids: list[int] | None = None,
        progress: Callable[[int], object] | None = None,
        on_request_done: Callable[[RequestOutput], object] | None = None,
    ) -> list[RequestOutput]:
        """Sample `params.n` completions for each prompt (token ids). request_ids (default 0..N-1) key the
        sampling noise together with params.seed: the same (seed, request id) gives the same completions
        whatever else is in the call. A prompt that is empty or too long gets `error` set; the others complete.
        `progress(k)` is called as k more samples finish.

        on_request_done: called once per prompt, as soon as all its samples have finished (refused prompts
        first, then in the order requests complete), with an output equal to the one returned for it (the same
        Sample objects). It runs in the engine's thread between two steps and changes nothing the engine
        schedules or samples; a caller in another thread can start using a group while the others generate
        (algorithm.overlap = "tail", exactrl/train/overlap.py)."""
        params.validate()
        if not prompts:
            return []
        request_ids = self._check_request_ids(prompts, request_ids)
        outputs = [RequestOutput(rid, list(p)) for rid, p in zip(request_ids, prompts)]
        valid = self._admissible(prompts, outputs)
        if on_request_done is not None:
            for i in sorted(set(range(len(prompts))) - set(valid)):
                on_request_done(outputs[i])
        if not valid:
            return outputs
        call = self._start(prompts, request_ids, valid, params, progress)
        if on_request_done is not None:
            call.on_request_done = on_request_done
        while call.step():
            pass
        call.fold_stats()
        call.collect(outputs)
        return outputs

    # -- the stages of a call ----------------------------------------------------------------------------
    @staticmethod
    def _check_request_ids(prompts: list[list[int]], request_ids: list[int] | None) -> list[int]:
        if request_ids is None:
            request_ids = list(range(len(prompts)))
        if len(request_ids) != len(prompts):
            raise ValueError(f"got {len(request_ids)} request_ids for {len(prompts)} prompts")
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids must be distinct (they key the sampling noise)")
        for rid in request_ids:
            if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 2**63:
                raise ValueError(f"request_ids must be ints in [0, 2**63), got {rid!r}")
        return list(request_ids)

    def _admissible(self, prompts: list[list[int]], outputs: list[RequestOutput]) -> list[int]:
        """Indices of the prompts the engine can run; the others get their output's `error` set."""
        # The effective limit: a prompt admitted past the model's positions would fail inside a step and take
        # every other prompt of the call down with it.
        max_len, vocab = self.max_model_len, self.model.config.vocab_size
        valid: list[int] = []
        for i, p in enumerate(prompts):
            if len(p) == 0:
                outputs[i].error = "empty prompt"
            elif len(p) + 1 > max_len:
                outputs[i].error = (
                    f"prompt has {len(p)} tokens; with at least one new token that exceeds "
                    f"{self._length_limit()}"
                )
            elif min(p) < 0 or max(p) >= vocab:
                outputs[i].error = f"prompt has token ids outside the vocabulary [0, {vocab})"
            else:
                valid.append(i)
        return valid

    def _start(
        self,
        prompts: list[list[int]],
        request_ids: list[int],
        valid: list[int],
        params: SamplingParams,
        progress: Callable[[int], object] | None,
        max_total_tokens: int | None = None,
        extra_rows: int = 0,
    ) -> _Generation:
        """Size the KV cache for the call, and queue one sequence per valid prompt in a fresh scheduler.

        max_total_tokens set: multi-turn sequences (episodes; see `start_turns`) whose whole conversation holds
        at most that many tokens, each turn at most params.max_tokens. extra_rows: sequences the caller adds to
        the scheduler beyond the n per valid prompt (partial rollouts' resumed samples)."""
        cfg = self.config
        limit = self.max_model_len if max_total_tokens is None else min(max_total_tokens, self.max_model_len)
        max_new = lambda p: min(params.max_tokens, limit - len(p))  # noqa: E731
        grow = lambda p: limit - len(p) if max_total_tokens is not None else max_new(p)  # noqa: E731
        tokens_needed = sum(
            # the prompt once (its n samples share it), then n completions (n whole conversations)
            len(prompts[i]) + params.n * grow(prompts[i])
            for i in valid
        )
        runner = self._ensure_runner(tokens_needed + cfg.block_size * params.n * len(valid))
        # The call never decodes more sequences at once than it holds: decode graphs up to that many rows.
        runner.refresh_graphs(params.n * len(valid) + extra_rows, agree=self.agree_blocks)
        bm = BlockManager(runner.num_blocks, cfg.block_size, enable_prefix_caching=cfg.enable_prefix_caching)
        sched = Scheduler(
            bm,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            prefill_chunk_size=min(cfg.prefill_chunk_size, cfg.max_num_batched_tokens),
        )
        call = _Generation(self, runner, sched, params, progress)
        for i in valid:
            seq = Sequence(
                sched.new_seq_id(),
                request_ids[i],
                prompts[i],
                max_tokens=max_new(prompts[i]),
                num_samples=params.n,
                stop_token_ids=list(params.stop_token_ids),
                multi_turn=max_total_tokens is not None,
            )
            call.by_req[request_ids[i]] = i
            sched.add(seq)
        return call


class _Generation:
    """The state of one `generate` call: its scheduler, the step in flight, the finished sequences.

    `step()` is one engine step: schedule -> (settle the previous step unless this one can run ahead) ->
    launch (copy-on-write, forward, LM head, sample, recorded logprob) -> settle the previous step -> commit."""

    def __init__(
        self,
        engine: RolloutEngine,
        runner: ModelRunner,
        sched: Scheduler,
        params: SamplingParams,
        progress: Callable[[int], object] | None,
    ) -> None:
        self.engine, self.runner, self.sched, self.params = engine, runner, sched, params
        self.model = engine.model
        self.stats = engine.stats
        self.progress = progress
        self.temperature = params.temperature if params.temperature > 0 else 1.0
        self.greedy = params.temperature == 0
        self.by_req: dict[int, int] = {}  # request id -> index of its prompt in the call
        self.text_len: dict[int, int] = {}  # seq id -> length of its decoded text at the last stop check
        self.finished: list[Sequence] = []
        self.pending: _Pending | None = None  # the last step, committed, its tokens still on their way back
        self.t_mark = time.perf_counter()
        # `generate(on_request_done=...)`: told of each request as its last sample finishes. The finished
        # sequences of the requests not complete yet, and the Sample built for each sequence (collect reuses it,
        # so the streamed and the returned outputs hold the same objects).
        self.on_request_done: Callable[[RequestOutput], object] | None = None
        self.unreported: dict[int, list[Sequence]] = {}
        self.samples: dict[int, Sample] = {}

    def step(self) -> bool:
        """Run one step; False once every sequence has finished and nothing is in flight. torch's
        deterministic algorithms are off for the step (`torch_determinism_off` says why); its kernels are launched
        back to back (`pdl_launches`: programmatic dependent launch on Hopper)."""
        with torch_determinism_off(), pdl_launches():
            return self._step()

    def _step(self) -> bool:
        sched = self.sched
        batch = sched.schedule() if sched.has_unfinished() else None
        if batch is None:
            if self.pending is None:
                self.take(sched.take_finished())
                return False
            self.settle(self.pending)
            self.pending = None
            return True
        if self.engine.trace is not None:
            self.engine.trace.append(
                (int(self.stats["steps"]), time.perf_counter(), len(sched.running), len(sched.waiting))
            )
        rows = batch.sample_rows()
        is_decode = all(e.is_decode for e in batch.entries)
        # Static buffers / CUDA graph: a pure decode step, one row per sequence.
        static = is_decode and len(rows) == len(batch.entries) and self.runner.can_decode(len(rows))
        # Forward, LM head, sampler and recorded logprob in one replay (no top-k / top-p filtering).
        fused = static and fused_sampling(self.params)
        # Such a step can run before the previous one is read back when that one was fused too: its pending
        # tokens are taken from the previous output on the device. Any other step needs them on the host.
        ahead = fused and self.pending is not None and self.pending.fused
        if self.pending is not None and not ahead:
            self.settle(self.pending)  # may finish sequences of this batch: their rows are dropped at commit
            self.pending = None
        out = self.launch(batch, rows, static, fused, ahead)
        self.stats["steps"] += 1
        self.stats["ahead_steps"] += ahead
        output = None
        if rows:
            assert out is not None  # `launch` returns None only when no row is sampled
            output = self.runner.fetch(out)
        if self.pending is not None:  # ran ahead: read the previous step back while this one runs
            self.settle(self.pending)
            self.pending = None
        receivers = sched.commit(batch)
        if output is not None:
            self.pending = _Pending(receivers, output, is_decode, fused)
        return True

    def launch(
        self, batch: ScheduledBatch, rows: list[SampleRow], static: bool, fused: bool, ahead: bool
    ) -> torch.Tensor | None:
        """Queue the step's work on the device: block copies, forward, and for sampled rows the token and its
        recorded logprob. Returns float64 [2, rows] (token, logprob), or None when no row is sampled."""
        runner, params, model = self.runner, self.params, self.model
        ops = model.ops
        runner.copy_blocks(batch.block_copies)
        if static:
            prev_row = {}
            if ahead:
                assert self.pending is not None  # ahead: the previous step is still in flight
                prev_row = {id(seq): k for k, seq in enumerate(self.pending.receivers) if seq is not None}
            drows = [
                DecodeRow(
                    e.seq.token_ids[e.start],
                    e.start,
                    e.block_table,
                    params.seed,
                    r.request_id,
                    r.sample_index,
                    prev_row.get(id(e.seq), -1),
                )
                for e, r in zip(batch.entries, rows)
            ]
            self.stats["static_decode_steps"] += 1
            self.stats["cuda_graph_steps"] += runner.decode_mode == "graph"
            if fused:
                return runner.decode_sample(drows, self.temperature, self.greedy)
            hidden, key_parts = runner.decode(drows)
            raw = model.head_logits(hidden)
        elif rows:
            entries = [StepEntry(e.token_ids, e.start, e.block_table) for e in batch.entries]
            hidden = runner.forward(entries)
            # A fork row is computed once and sampled n times: one LM-head matmul per distinct row.
            uniq, inv = np.unique(np.array([r.entry_index for r in rows]), return_inverse=True)
            parts = np.array(
                [
                    [params.seed] * len(rows),
                    [r.request_id for r in rows],
                    [r.sample_index for r in rows],
                    [r.position for r in rows],
                ],
                dtype=np.int64,
            )
            # Built on the host, one asynchronous copy: nothing here waits for the GPU.
            uniq_d, inv_d, key_parts = upload_int64([uniq, inv.reshape(-1), parts], model.device)
            raw = model.head_logits(hidden[uniq_d])[inv_d]
        else:  # prefill chunks that sample nothing yet
            runner.forward([StepEntry(e.token_ids, e.start, e.block_table) for e in batch.entries])
            return None
        z = ops.scale_logits(raw, self.temperature)
        tok = sample_tokens(z, key_parts, params, self.greedy)
        # The recorded logprob: the trainer's logprobs op on the same raw logits row (bitwise equal).
        lp = ops.logprobs_from_logits(raw, tok, self.temperature)
        return torch.stack((tok.to(torch.float64), lp.to(torch.float64)))

    def settle(self, step: _Pending) -> None:
        """Wait for a committed step's tokens, resolve them, check stop strings, collect the finished."""
        tok_l, lp_l = step.output.result()
        receivers = self.sched.resolve(step.receivers, tok_l, lp_l)
        now = time.perf_counter()
        self.stats["decode_s" if step.is_decode else "prefill_s"] += now - self.t_mark
        self.t_mark = now
        stop, tokenizer = self.params.stop, self.engine.tokenizer
        if stop and tokenizer is not None:
            for seq in receivers:
                if seq.turn_ended:
                    continue
                # The current turn's text (the whole completion for a single-turn sequence): a stop string
                # ends the turn it appears in, never a later one.
                text = tokenizer.decode(seq.turn_token_ids)
                if find_stop_string(text, stop, self.text_len.get(seq.seq_id, 0)) is not None:
                    self.sched.finish(seq, "stop")
                self.text_len[seq.seq_id] = len(text)
        done = self.sched.take_finished()
        if done and self.progress is not None:
            with pdl_launches(False):  # the caller's code: launches as it would outside the engine
                self.progress(len(done))
        self.take(done)

    def fold_stats(self) -> None:
        """Add the call's scheduler and block-manager counts to the engine's (once, when the call ends)."""
        stats = self.engine.stats
        stats["preemptions"] += self.sched.num_preemptions
        for k, v in self.sched.block_manager.stats.items():
            stats[k] = stats.get(k, 0) + v

    def take(self, done: list[Sequence]) -> None:
        """Keep finished sequences; with `on_request_done`, report each request whose samples have all finished."""
        self.finished.extend(done)
        if self.on_request_done is None:
            return
        for seq in done:
            group = self.unreported.setdefault(seq.request_id, [])
            group.append(seq)
            # A forked sample counts 1; a prompt that failed before its fork still stands for all n samples.
            if sum(s.num_samples for s in group) < self.params.n:
                continue
            del self.unreported[seq.request_id]
            out = RequestOutput(seq.request_id, list(group[0].prompt_token_ids))
            self.fill(out, group)
            with pdl_launches(False):  # the caller's code (e.g. a reward that scores on the GPU): no PDL
                self.on_request_done(out)

    def collect(self, outputs: list[RequestOutput]) -> None:
        """Put every finished sequence into its request's output, in (request, sample) order."""
        for seq in sorted(self.finished, key=lambda s: (s.request_id, s.sample_index)):
            self.fill(outputs[self.by_req[seq.request_id]], [seq])

    def fill(self, out: RequestOutput, seqs: list[Sequence]) -> None:
        """Put finished sequences of one request into its output, in sample order (an error sets `error`)."""
        for seq in sorted(seqs, key=lambda s: s.sample_index):
            if seq.finish_reason and seq.finish_reason.startswith("error"):
                out.error = seq.finish_reason
                continue
            out.samples.append(self.sample_of(seq))

    def sample_of(self, seq: Sequence) -> Sample:
        """The finished sequence as a Sample (built once per sequence)."""
        smp = self.samples.get(seq.seq_id)
        if smp is not None:
            return smp
        stop, tokenizer = self.params.stop, self.engine.tokenizer
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(seq.completion_token_ids)
            if stop:
                cut = find_stop_string(text, stop, 0)
                if cut is not None:
                    ends = [cut + len(s) for s in stop if text.startswith(s, cut)]
                    text = text[: max(ends)] if ends else text
        smp = Sample(
            seq.completion_token_ids,
            torch.tensor(seq.rollout_logprobs, dtype=torch.float32),
            seq.finish_reason or "length",
            text,
        )
        self.samples[seq.seq_id] = smp
        return smp


@dataclass
class _Pending:
    """A committed step whose sampled tokens are still on their way back (runner.StepOutput)."""

    receivers: list[Sequence | None]
    output: StepOutput
    is_decode: bool
    fused: bool  # its tokens are also in the runner's last_tokens (decode_sample)


def fused_sampling(params: SamplingParams) -> bool:
    """Whether the call's tokens can come from the fused Triton sampler (no top-k / top-p filtering)."""
    return not params.top_k and params.top_p >= 1


def sample_tokens(
    z: torch.Tensor, key_parts: torch.Tensor, params: SamplingParams, greedy: bool
) -> torch.Tensor:
    """Draw one token per row of temperature-scaled fp32 logits z with the call's options; key_parts: int64
    [4, rows], each row's (seed, request_id, sample_index, position), the inputs of its noise key.

    On CUDA without top-k / top-p, the fused Triton kernel (one pass over the logits, keys derived inside)
    draws the same tokens as `sample`, bit for bit (tests/ops/test_triton_sampling.py); everything else goes
    through `sample`."""
    dev = z.device
    rows = z.shape[0]
    if z.is_cuda and fused_sampling(params):
        from exactrl.ops.triton.sampling import gumbel_argmax

        g = torch.ones(rows, dtype=torch.bool, device=dev) if greedy else None
        return gumbel_argmax(z, None, g, key_parts=key_parts)
    keys = noise_keys(key_parts[0], key_parts[1], key_parts[2], key_parts[3])
    return sample(
        z,
        keys,
        top_k=torch.full((rows,), params.top_k, device=dev) if params.top_k else None,
        top_p=torch.full((rows,), params.top_p, device=dev) if params.top_p < 1 else None,
        greedy=torch.ones(rows, dtype=torch.bool, device=dev) if greedy else None,
    )
