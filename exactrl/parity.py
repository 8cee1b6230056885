"""`exactrl parity`: the engine's recorded logprobs against the trainer's, token by token, and the sampled tokens
of the same requests across batch compositions.

The defaults exercise what an RL step does: several samples per prompt (the group shares the prompt's KV blocks,
so forks and copy-on-write run), prompts that share a prefix (prefix-cache hits), a temperature other than 1, a KV
cache too small for all requests at once (preemption and recompute) and chunked prefill. Completions are generated
under several batch compositions (one request at a time, all together, in reverse order, interleaved with
unrelated prompts), the token ids must agree across all of them (the sampling noise is keyed on the request, never
on the batch row), then the tokens are scored by the training path in packed microbatches of several sizes and
must equal the recorded logprobs bitwise. A line says what was exercised (counted by the engine's block manager).

Under torchrun (`exactrl parity --nproc N`) every rank checks its share of the prompts (under their global
request ids, so each prompt samples what it samples on one process) with its own engine on a full replica, and
scores through the trainer's real forward: an FSDP2-sharded copy of the model (fp32 shards, compute in the model
dtype), the replica refreshed from the shards as after a training step. The counts are summed over the ranks.
With `--tensor-parallel T` each group of T ranks shares one engine split over them (exactrl/distributed/
tensor_parallel.py), its weights taken from the trainer's shards by the weight sync; the trainer is the same FSDP2
model, so the check is the split engine against the trainer, token by token.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from exactrl.distributed.env import DistContext
from exactrl.distributed.shared_engine import split_engine_model
from exactrl.distributed.tensor_parallel import TensorParallelGroup
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.qwen import CausalLM
from exactrl.ops.fp8 import Fp8Ops
from exactrl.train.packing import PackedBatch, packed_microbatches, response_logprobs

_BLOCK_STATS = ("prefix_hit_blocks", "fork_shared_blocks", "cow_copies")


@contextmanager
def _counting_block_managers(engine: RolloutEngine):
    """The block managers' bookkeeping counters (prefix hits, fork-shared blocks, copy-on-write copies) added up
    over the engine calls made inside the block (the engine sums them into `engine.stats` per call)."""
    before = {k: engine.stats[k] for k in _BLOCK_STATS}
    totals: dict[str, float] = {}
    yield totals
    totals.update({k: engine.stats[k] - before[k] for k in _BLOCK_STATS})


@dataclass
class ParityResult:
    mode: str
    device: str
    dtype: str
    temperature: float
    num_tokens: int
    num_mismatched: int
    max_abs_diff: float
    mean_abs_diff: float
    num_compositions: int
    tokens_identical_across_compositions: bool
    seconds: float
    preemptions: int
    samples_per_prompt: int = 1
    kv_blocks: int | None = None
    prefill_chunk: int = 0
    num_sequences: int = 0
    sequences_with_other_tokens: int = 0
    """Sequences whose token ids differ between some composition and the one-at-a-time reference."""
    prefix_hit_blocks: int = 0
    fork_shared_blocks: int = 0
    cow_copies: int = 0
    compositions: list[str] = field(default_factory=list)
    world_size: int = 1
    """Ranks whose shares the figures sum (under torchrun: each with its engine and the FSDP-sharded trainer)."""
    tensor_parallel: int = 1
    """Ranks that shared one engine (each holding 1/T of its weights and KV cache)."""
    expert_parallel: int = 1
    """Ranks that shared one engine's routed experts (each holding 1/E of every sparse layer's)."""
    precision: str = "dtype"
    """The projections' arithmetic (model.precision): "dtype" or "fp8"."""

    @property
    def ok(self) -> bool:
        return self.num_mismatched == 0 and self.tokens_identical_across_compositions

    def exercised(self) -> str:
        """One line: what the check made the engine do (so a pass means something)."""
        parts = [
            f"{self.samples_per_prompt} samples per prompt",
            f"T = {self.temperature:g}",
            f"{self.preemptions} preemptions",
            f"{self.prefix_hit_blocks} prefix-cache block hits",
            f"{self.fork_shared_blocks} blocks shared by forks",
            f"{self.cow_copies} copy-on-write copies",
            f"prefill chunks of {self.prefill_chunk} tokens",
            f"{len(self.compositions)} batch compositions ({', '.join(self.compositions)})",
        ]
        if self.tensor_parallel > 1:
            parts.append(f"each engine split over {self.tensor_parallel} ranks (engine.tensor_parallel)")
        if self.expert_parallel > 1:
            parts.append(f"the experts split over {self.expert_parallel} ranks (engine.expert_parallel)")
        missing = [
            name
            for name, n in (
                ("preemption (lower --kv-blocks)", self.preemptions),
                ("prefix sharing (--samples-per-prompt > 1)", self.fork_shared_blocks),
                ("copy-on-write", self.cow_copies),
            )
            if n == 0
        ]
        line = "exercised: " + ", ".join(parts)
        if missing:
            line += "; NOT exercised: " + ", ".join(missing)
        return line

    def to_dict(self) -> dict:
        return dict(self.__dict__) | {"ok": self.ok}


def random_prompts(
    num: int, vocab: int, seed: int, min_len: int = 2, max_len: int = 48, shared_prefix: int = 0
) -> list[list[int]]:
    """Prompts of varied lengths; ids drawn below `vocab` (the tokenizer's size, so specials stay rare). With
    shared_prefix > 0, every other prompt starts with the same shared_prefix tokens (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    prefix = torch.randint(0, vocab, (shared_prefix,), generator=g).tolist()
    out = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    return [prefix + p if i % 2 == 0 else p for i, p in enumerate(out)]


def small_kv_blocks(prompts: list[list[int]], max_tokens: int, samples: int, block_size: int) -> int:
    """A KV cache that holds the largest single request (all its samples at full length) with room for about
    one more: every request can run, but not all at once, so the scheduler must preempt."""
    per_request = max(samples * math.ceil((len(p) + max_tokens) / block_size) + 1 for p in prompts)
    return 2 * per_request


def sharded_parity_models(
    model: CausalLM,
    ctx: DistContext,
    tp: TensorParallelGroup | None = None,
    *,
    tensor_parallel: int | None = None,
    expert_parallel: int = 1,
    fp8_copies: str = "kept",
) -> tuple[CausalLM, CausalLM]:
    """(the engine's model, the trainer's model) of a run at ctx's world size: on one process both are `model`;
    under torchrun `model` is sharded in place with FSDP2 as training shards it, and the engine gets a full
    replica refreshed from the shards by the training path's weight sync. With a tensor-parallel group `tp` the
    replica is split over the group first (`shard_engine_model`) and the sync copies each rank's slice of every
    gathered weight into it."""
    from exactrl.distributed.parallelize import Parallelism

    par = Parallelism(ctx, fp8_copies=fp8_copies)  # fp8: the trainer's copies (train.fsdp_fp8_copies)
    replica = par.engine_model(model)
    if tp is not None and tp.size > 1:
        # tensor_parallel unset: the group's size (the engine split by tensor parallel alone).
        t = tp.size if tensor_parallel is None else tensor_parallel
        replica = split_engine_model(replica, tp, t, expert_parallel)
    par.parallelize(model, trainable=False)
    par.bind(model, replica)
    par.sync_weights(full=True)
    return replica, model


@torch.no_grad()
def _score_jobs(
    scorer: CausalLM, jobs: list[tuple[list[list[int]], list[int], float, int]], ctx: DistContext
) -> list[list[torch.Tensor]]:
    """Completion logprobs through the training forward for each job (seqs, prompt lens, temperature, tokens per
    microbatch). Under FSDP every forward all-gathers: the ranks first agree on the number of microbatches, and
    a rank with fewer runs forwards of a 2-token dummy sequence until it has run as many."""
    plans = [list(packed_microbatches(seqs, plens, budget, scorer.device)) for seqs, plens, _, budget in jobs]
    mine = sum(len(p) for p in plans)
    extra = int(ctx.max(mine)) - mine
    out: list[list[torch.Tensor]] = []
    for (seqs, _, temperature, _), plan in zip(jobs, plans):
        lps: list[torch.Tensor | None] = [None] * len(seqs)
        for mb, pb in plan:
            lp, _, sidx = response_logprobs(scorer, pb, temperature)
            for j, i in enumerate(mb):
                lps[i] = lp[sidx == j].float().cpu()
        out.append(lps)  # type: ignore[arg-type]
    for _ in range(extra):
        response_logprobs(scorer, PackedBatch.build([[0, 0]], [1], scorer.device), 1.0)
    return out


def run_parity(
    model: CausalLM,
    *,
    num_prompts: int = 6,
    max_tokens: int = 16,
    temperature: float = 0.7,
    seed: int = 0,
    samples_per_prompt: int = 4,
    kv_blocks: int | None = 0,
    prefill_chunk: int = 16,
    block_size: int = 16,
    shared_prefix: int = 16,
    prompt_vocab: int | None = None,
    microbatch_tokens: tuple[int, ...] = (64, 1000, 1 << 30),
    scorer: CausalLM | None = None,
    dist: DistContext | None = None,
    tp: TensorParallelGroup | None = None,
    tensor_parallel: int | None = None,
    expert_parallel: int = 1,
) -> ParityResult:
    """kv_blocks: 0 = small_kv_blocks (preemption), None = sized from memory.

    model: what the engine samples from; scorer: the trainer-side model that scores the tokens (default `model`;
    under torchrun the FSDP-sharded copy, see `sharded_parity_models`). dist: this rank's place; the result is
    the sum over every rank's share of the prompts (every rank returns it). tp: the tensor-parallel group `model`
    is split over: its ranks share one engine, so they take the same share of the prompts (the group's), run the
    same engine calls, and only the group's first rank counts them (each rank still scores and compares; the ranks
    of a group must have recorded the same tokens and logprobs, or the check fails)."""
    start = time.perf_counter()
    ctx = dist or DistContext.single()
    scorer = scorer or model
    vocab = prompt_vocab or model.config.vocab_size
    all_prompts = random_prompts(num_prompts, vocab, seed, shared_prefix=shared_prefix)
    all_others = random_prompts(num_prompts, vocab, seed + 1)
    # This rank's share, under the prompts' global indices: each request samples what it samples at world size 1.
    engines = ctx.world_size if tp is None else tp.dp_size
    if num_prompts < engines:
        what = f"ranks ({ctx.world_size})" if tp is None else f"engines ({engines})"
        raise ValueError(f"--num-prompts ({num_prompts}) must be at least the number of {what}")
    ids = list(
        ctx.shard(num_prompts) if tp is None else DistContext(tp.dp_rank, tp.dp_size).shard(num_prompts)
    )
    prompts = [all_prompts[i] for i in ids]
    others = [all_others[i] for i in ids]
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=samples_per_prompt)
    if kv_blocks == 0:
        # sized for every rank's prompts: each rank's cache is the one a single process would have
        kv_blocks = small_kv_blocks(all_prompts + all_others, max_tokens, samples_per_prompt, block_size)
    cfg = EngineConfig(
        block_size=block_size,
        num_kv_blocks=kv_blocks,
        prefill_chunk_size=prefill_chunk,
        max_num_batched_tokens=max(prefill_chunk, 256),
        max_model_len=4096,  # what `exactrl parity` always ran with (the engine's old default; the config's is 2048)
    )
    engine = RolloutEngine(model, cfg)
    rev = ids[::-1]
    with _counting_block_managers(engine) as block_stats:
        compositions = {
            "one-at-a-time": [engine.generate([p], params, request_ids=[i])[0] for i, p in zip(ids, prompts)],
            "all-together": engine.generate(prompts, params, request_ids=ids),
            # the same requests in the opposite order: other rows, other preemption victims
            "reversed": engine.generate(prompts[::-1], params, request_ids=rev)[::-1],
            # unrelated prompts interleaved, under other request ids: our rows must not notice them
            "mixed": engine.generate(
                [x for pair in zip(others, prompts) for x in pair],
                params,
                request_ids=[x for i in ids for x in (10_000 + i, i)],
            )[1::2],
        }
    errors = [o.error for outs in compositions.values() for o in outs if o.error]
    if errors:
        raise ValueError(f"the engine refused a parity request: {errors[0]} (raise --kv-blocks)")
    preemptions = int(engine.stats.get("preemptions", 0))
    reference = compositions["one-at-a-time"]
    other_tokens = 0
    for i, ref in enumerate(reference):  # i: the position in this rank's share
        ref_tokens = [s.token_ids for s in ref.samples]
        for j in range(samples_per_prompt):
            if any(
                [s.token_ids for s in outs[i].samples][j] != ref_tokens[j] for outs in compositions.values()
            ):
                other_tokens += 1
    # Compositions that sampled the same tokens are scored once; every job is scored before any is compared, so
    # the ranks run their (collective) forwards together.
    t = temperature if temperature > 0 else 1.0
    jobs: dict[tuple, tuple[list[list[int]], list[int], float, int]] = {}
    checks: list[tuple[tuple, list[torch.Tensor]]] = []
    for outs in compositions.values():
        seqs, plens, recorded = [], [], []
        for prompt, out in zip(prompts, outs):
            for s in out.samples:
                if not s.token_ids:
                    continue
                seqs.append(prompt + s.token_ids)
                plens.append(len(prompt))
                recorded.append(s.rollout_logprobs)
        for budget in microbatch_tokens:
            key = (budget, tuple(tuple(x) for x in seqs))
            jobs.setdefault(key, (seqs, plens, t, budget))
            checks.append((key, recorded))
    scored = dict(zip(jobs, _score_jobs(scorer, list(jobs.values()), ctx)))
    num, bad, max_diff, sum_diff = 0, 0, 0.0, 0.0
    for key, recorded in checks:
        for rec, lp in zip(recorded, scored[key]):
            d = (rec.float() - lp).abs()
            num += lp.numel()
            bad += int((rec != lp).sum())
            max_diff = max(max_diff, float(d.max()))
            sum_diff += float(d.sum())
    if tp is not None and tp.size > 1:
        # One engine over the group: its ranks sampled the same tokens with the same logprobs, or the split broke.
        mine = [[(s.token_ids, s.rollout_logprobs.tolist()) for s in o.samples] for o in reference]
        split_disagrees = int(any(x != mine for x in tp.gather_objects(mine)))
        lead = tp.rank == 0
    else:
        split_disagrees, lead = 0, True
    # The whole check's figures: sums (and the maximum) over the ranks (over the engines with tensor parallel).
    counts = [num, bad, other_tokens, preemptions, *(block_stats[k] for k in _BLOCK_STATS)]
    counts = [x if lead else 0 for x in counts]
    counts[1] += split_disagrees  # a group whose ranks disagree fails the check
    num, bad, other_tokens, preemptions, *blocks = (int(x) for x in ctx.all_reduce(counts))
    block_stats = dict(zip(_BLOCK_STATS, blocks))
    sum_diff, max_diff = ctx.sum(sum_diff), ctx.max(max_diff)
    return ParityResult(
        mode="exact" if model.ops.exact else "fast",
        precision="fp8" if isinstance(model.ops, Fp8Ops) else "dtype",
        device=str(model.device),
        dtype=str(model.dtype).replace("torch.", ""),
        temperature=temperature,
        num_tokens=num,
        num_mismatched=bad,
        max_abs_diff=max_diff,
        mean_abs_diff=sum_diff / max(num, 1),
        num_compositions=len(compositions) * len(microbatch_tokens),
        tokens_identical_across_compositions=other_tokens == 0,
        seconds=time.perf_counter() - start,
        preemptions=preemptions,
        samples_per_prompt=samples_per_prompt,
        kv_blocks=kv_blocks,
        prefill_chunk=prefill_chunk,
        num_sequences=num_prompts * samples_per_prompt,
        sequences_with_other_tokens=other_tokens,
        prefix_hit_blocks=int(block_stats["prefix_hit_blocks"]),
        fork_shared_blocks=int(block_stats["fork_shared_blocks"]),
        cow_copies=int(block_stats["cow_copies"]),
        compositions=list(compositions),
        world_size=ctx.world_size,
        tensor_parallel=(1 if tp is None else tp.size) if tensor_parallel is None else tensor_parallel,
        expert_parallel=expert_parallel,
    )
