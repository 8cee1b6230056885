"""`exactrl parity`: the engine's recorded logprobs against the trainer's, token by token.

Completions are generated through the paged-KV decode path under several batch compositions (one prompt at a
time, all together, mixed with unrelated prompts; optionally with n samples per prompt, a tiny KV cache that
forces preemption, and chunked prefill), then the same tokens are scored by the training path in packed
microbatches of several sizes. Exact mode must show zero mismatches; fast mode shows what everyone else lives
with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.qwen import CausalLM
from exactrl.train.packing import completion_logprobs


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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def random_prompts(num: int, vocab: int, seed: int, min_len: int = 2, max_len: int = 48) -> list[list[int]]:
    """Prompts of varied lengths; ids drawn below `vocab` (the tokenizer's size, so specials stay rare)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def run_parity(
    model: CausalLM,
    *,
    num_prompts: int = 16,
    max_tokens: int = 128,
    temperature: float = 1.0,
    seed: int = 0,
    samples_per_prompt: int = 1,
    kv_blocks: int | None = None,
    prefill_chunk: int = 2048,
    block_size: int = 16,
    prompt_vocab: int | None = None,
    microbatch_tokens: tuple[int, ...] = (64, 1000, 1 << 30),
) -> ParityResult:
    start = time.perf_counter()
    vocab = prompt_vocab or model.config.vocab_size
    prompts = random_prompts(num_prompts, vocab, seed)
    others = random_prompts(num_prompts, vocab, seed + 1)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed, n=samples_per_prompt)
    cfg = EngineConfig(
        block_size=block_size,
        num_kv_blocks=kv_blocks,
        prefill_chunk_size=prefill_chunk,
        max_num_batched_tokens=max(prefill_chunk, 256),
    )
    engine = RolloutEngine(model, cfg)
    ids = list(range(num_prompts))
    compositions = {
        "one-at-a-time": [engine.generate([p], params, request_ids=[i])[0] for i, p in zip(ids, prompts)],
        "all-together": engine.generate(prompts, params, request_ids=ids),
        # unrelated prompts interleaved, under other request ids: our rows must not notice them
        "mixed": engine.generate(
            [x for pair in zip(others, prompts) for x in pair],
            params,
            request_ids=[x for i in ids for x in (10_000 + i, i)],
        )[1::2],
    }
    preemptions = engine.stats.get("preemptions", 0)
    reference = compositions["one-at-a-time"]
    same_tokens = all(
        [s.token_ids for s in out.samples] == [s.token_ids for s in ref.samples]
        for outs in compositions.values()
        for out, ref in zip(outs, reference)
    )
    num, bad, max_diff, sum_diff = 0, 0, 0.0, 0.0
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
            lps = completion_logprobs(model, seqs, plens, temperature if temperature > 0 else 1.0, budget)
            for rec, lp in zip(recorded, lps):
                d = (rec.float() - lp).abs()
                num += lp.numel()
                bad += int((rec != lp).sum())
                max_diff = max(max_diff, float(d.max()))
                sum_diff += float(d.sum())
    return ParityResult(
        mode="exact" if model.ops.exact else "fast",
        device=str(model.device),
        dtype=str(model.dtype).replace("torch.", ""),
        temperature=temperature,
        num_tokens=num,
        num_mismatched=bad,
        max_abs_diff=max_diff,
        mean_abs_diff=sum_diff / max(num, 1),
        num_compositions=len(compositions) * len(microbatch_tokens),
        tokens_identical_across_compositions=same_tokens,
        seconds=time.perf_counter() - start,
        preemptions=preemptions,
    )
