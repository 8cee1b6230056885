"""Supervised warm start: cross-entropy on the completion tokens of (prompt, answer) pairs, through the same
packed path and exact ops as RL. A random tiny model cannot be taught by RL alone; SFT gets it started."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from exactrl.config import episode_token_limit
from exactrl.model.qwen import CausalLM
from exactrl.model.tokenizer import Tokenizer
from exactrl.tasks.base import Example
from exactrl.tasks.chat import ChatTemplateError
from exactrl.tasks.prompts import PromptFilter
from exactrl.train.logging import progress_bar
from exactrl.train.optim import MasterAdamW, lr_factor, set_lr
from exactrl.train.packing import (
    masked_packed_batch,
    pack_by_tokens,
    packed_microbatches,
    response_logprobs,
)

T = TypeVar("T")


def sft_step(
    model: CausalLM,
    opt: MasterAdamW,
    prompts: list[list[int]],
    completions: list[list[int]],
    *,
    max_tokens_per_microbatch: int = 8192,
    grad_clip: float = 1.0,
    loss_masks: list[list[bool]] | None = None,
) -> dict[str, float]:
    """One optimizer step of token-mean negative log-likelihood over all completion tokens of the batch.

    loss_masks: one per completion, True at the tokens to learn (a worked episode's model turns), False at the
    others (its observations, which the environment writes); None = every completion token."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    plens = [len(p) for p in prompts]
    if loss_masks is None:
        n_tok = sum(len(c) for c in completions)
        batches = packed_microbatches(seqs, plens, max_tokens_per_microbatch, model.device)
    else:
        n_tok = sum(int(sum(m)) for m in loss_masks)
        batches = (
            (
                mb,
                masked_packed_batch(
                    [seqs[i] for i in mb], [plens[i] for i in mb], [loss_masks[i] for i in mb], model.device
                ),
            )
            for mb in pack_by_tokens([len(x) - 1 for x in seqs], max_tokens_per_microbatch)
        )
    if n_tok == 0:
        raise ValueError("SFT batch has no completion tokens")
    total_nll = 0.0
    correct = 0
    for _, pb in batches:
        lp, _, _ = response_logprobs(model, pb)
        loss = -lp.sum() / n_tok  # one divisor for the whole step: independent of the microbatch cut
        loss.backward()
        total_nll += float(-lp.detach().sum())
        correct += int((lp.detach() > -0.6931).sum())  # p > 0.5 means the token is the argmax
    norm = opt.clip_and_step(grad_clip)
    return {
        "sft/loss": total_nll / n_tok,
        "sft/token_acc_lb": correct / n_tok,
        "sft/grad_norm": norm,
        "sft/tokens": float(n_tok),
    }


def batch_iter(examples: Iterable[T], batch_size: int) -> Iterator[list[T]]:
    """Consecutive full batches of `batch_size` items (a last partial batch is dropped)."""
    batch = []
    for ex in examples:
        batch.append(ex)
        if len(batch) == batch_size:
            yield batch
            batch = []


def sft_tokens(tokenizer: Tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """Prompt ids and completion ids (answer + end-of-sequence)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return tokenizer.encode(prompt), tokenizer.encode(answer) + eos


def demonstration_tokens(
    tokenizer: Tokenizer, segments: list[tuple[str, bool]]
) -> tuple[list[int], list[bool]]:
    """A worked episode's completion ids and loss mask: each segment tokenized on its own (as an episode's turns
    and observations are: never across a boundary), the model's segments learned, the observations not; then
    end-of-sequence, learned (it ends the model's last turn)."""
    ids: list[int] = []
    mask: list[bool] = []
    for text, by_model in segments:
        seg = tokenizer.encode(text)
        ids += seg
        mask += [bool(by_model)] * len(seg)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        mask.append(True)
    return ids, mask


def sft_batches(
    examples: Iterator[Example],
    encode: Callable[[Example], list[int]],
    tokenizer: Tokenizer,
    batch_size: int,
    prompt_filter: PromptFilter,
    max_skips_in_a_row: int,
    demonstrate: Callable[[Example], list[tuple[str, bool]]] | None = None,
) -> Iterator[tuple[list[list[int]], list[list[int]], list[list[bool]] | None]]:
    """Batches of (prompt ids, completion ids, loss masks) for `sft_step`, from an example stream.

    Without `demonstrate` the completion is the example's answer (every token learned, masks None); with it
    (a multi-turn run whose environment has a `demonstration`), the worked episode it returns.

    An example whose prompt cannot be rendered (its chat template raises) or does not fit the run's limits (see
    `PromptFilter`: no tokens, longer than task.max_prompt_tokens, prompt + answer longer than engine.max_model_len)
    is skipped, counted in `prompt_filter.skipped` and logged with its `path:line`, as the RL loop does. After
    `max_skips_in_a_row` skips in a row the stream is taken to hold nothing usable: ValueError, instead of a hang.
    """
    prompts: list[list[int]] = []
    completions: list[list[int]] = []
    masks: list[list[bool]] = []
    in_a_row = 0
    for ex in examples:
        try:
            ids = encode(ex)
        except ChatTemplateError as e:  # names the record already
            prompt_filter.reject(ex, str(e).split(": ", 1)[-1])
            ids = None
        if demonstrate is None:
            completion, mask = sft_tokens(tokenizer, "", ex.answer)[1], []
        else:
            completion, mask = demonstration_tokens(tokenizer, demonstrate(ex))
        if ids is None or not prompt_filter.admit(ex, ids, len(completion)):
            in_a_row += 1
            if in_a_row >= max_skips_in_a_row:
                raise ValueError(
                    f"SFT: {in_a_row} examples in a row were skipped (the log names them and why); check "
                    "task.max_prompt_tokens, engine.max_model_len, task.prompt_field and the chat template"
                )
            continue
        in_a_row = 0
        prompts.append(ids)
        completions.append(completion)
        masks.append(mask)
        if len(prompts) == batch_size:
            yield prompts, completions, (masks if demonstrate is not None else None)
            prompts, completions, masks = [], [], []


@dataclass
class SFTResult:
    last: dict[str, float] = field(default_factory=dict)
    """The metrics of the last SFT step."""
    steps_done: int = 0
    stopped: bool = False
    """True when should_stop() ended SFT before sft.steps (Ctrl-C)."""
    filter: PromptFilter | None = None
    """The filter that skipped records that do not fit (its `skipped` count)."""


def run_sft(
    cfg: Any,
    model: CausalLM,
    tok: Tokenizer,
    encode: Callable[[Any], list[int]],
    task: Any,
    log: Callable[[dict[str, Any]], None],
    *,
    should_stop: Callable[[], bool] = lambda: False,
    out: Callable[[str], None] = print,
    demonstrate: Callable[[Example], list[tuple[str, bool]]] | None = None,
) -> SFTResult:
    """The supervised warm start of a RunConfig (its [sft] section). Uses a copy of the task stream seeded apart
    from the RL stream. `demonstrate`: a multi-turn run's worked episodes (`Environment.demonstration`), whose
    observations are masked out of the loss; None = the examples' answers. `should_stop` is asked after every
    step (the loop's Ctrl-C flag): when it says so, SFT ends after the step it finished, its last metrics are
    logged, and the result says `stopped`."""
    s = cfg.sft
    opt = MasterAdamW(model, lr=s.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)
    stream = copy.deepcopy(task).train_examples(seed=cfg.run.seed + 1_000_003)
    res = SFTResult()
    # A record that does not fit is skipped and named (file:line), as in RL; sequences must also fit a microbatch.
    limit = min(cfg.engine.max_model_len, cfg.train.max_tokens_per_microbatch)
    if demonstrate is not None:  # a worked episode is held to the episode's limit, as the RL episodes are
        limit = min(limit, episode_token_limit(cfg))
    res.filter = PromptFilter(cfg.task.max_prompt_tokens, limit, cfg.sampling.max_tokens, log=out)
    max_skips = 2 * getattr(task, "num_train", 5_000) + 1
    batches = sft_batches(stream, encode, tok, s.batch_size, res.filter, max_skips, demonstrate)
    bar = progress_bar(s.steps, "sft", enabled=cfg.run.progress)
    for step, (prompts, completions, masks) in enumerate(batches):
        if step >= s.steps:
            break
        set_lr(
            opt, s.lr * lr_factor(step, warmup_steps=s.warmup_steps, total_steps=s.steps, schedule="cosine")
        )
        res.last = sft_step(
            model,
            opt,
            prompts,
            completions,
            max_tokens_per_microbatch=cfg.train.max_tokens_per_microbatch,
            grad_clip=cfg.train.grad_clip,
            loss_masks=masks,
        )
        res.steps_done = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{res.last['sft/loss']:.3f}")
        stop = should_stop() and res.steps_done < s.steps
        if step % 25 == 0 or step == s.steps - 1 or stop:
            log({"sft_step": step, **res.last})
        if stop:
            res.stopped = True
            break
    bar.close()
    return res


__all__ = [
    "SFTResult",
    "batch_iter",
    "demonstration_tokens",
    "run_sft",
    "sft_batches",
    "sft_step",
    "sft_tokens",
]
