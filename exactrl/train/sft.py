"""Supervised warm start: cross-entropy on the completion tokens of (prompt, answer) pairs, through the same
packed path and exact ops as RL. A random tiny model cannot be taught by RL alone; SFT gets it started.

What SFT leaves in the run folder:
  sft-checkpoints/step-N/   resumable checkpoints (weights, optimizer, data position; `checkpoint.save_checkpoint`'s
                            layout), every sft.save_every steps and when a signal stops the run; removed once SFT
                            has finished
  sft/                      the weights after SFT (an HF checkpoint), with sft_state.json: how many of the steps
                            it holds and whether SFT finished. `--resume` continues an unfinished SFT from its
                            last checkpoint and skips a finished one; it never starts SFT over on top of sft/.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from exactrl.config import episode_token_limit
from exactrl.model.hf import save_model
from exactrl.model.qwen import CausalLM
from exactrl.model.tokenizer import Tokenizer
from exactrl.tasks.base import Example
from exactrl.tasks.chat import ChatTemplateError
from exactrl.tasks.prompts import PromptFilter
from exactrl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
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
        mask: list[bool]
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


SFT_CHECKPOINTS = "sft-checkpoints"  # under the run's output_dir
SFT_STATE = "sft_state.json"  # in sft/: how far the SFT that wrote the weights got
# The SFT stream is seeded apart from the RL stream (the same examples in another order).
SFT_SEED_OFFSET = 1_000_003


@dataclass
class SFTCheckpointing:
    """Where and when `run_sft` writes resumable checkpoints, and the one to continue from."""

    root: Path
    """The checkpoints' folder (<output_dir>/sft-checkpoints)."""
    tokenizer: Tokenizer
    every: int = 0
    """sft.save_every: a checkpoint every that many steps (0: only when stopped)."""
    keep: int = 2
    resume_from: Path | None = None
    """A checkpoint of this SFT to continue from (weights, optimizer, data position, step)."""
    write: bool = True
    """Whether this process writes (rank 0; every rank holds the same weights during SFT)."""
    barrier: Callable[[], None] = lambda: None
    """Waits for the writer (under torchrun: the other ranks read nothing before it is done)."""
    extra_state: Callable[[], dict[str, Any]] = dict
    """More of the run's state to save with each checkpoint (its elapsed time)."""


@dataclass
class SFTResult:
    last: dict[str, float] = field(default_factory=dict)
    """The metrics of the last SFT step."""
    steps_done: int = 0
    """SFT steps the weights hold (those of an earlier invocation included, when resumed)."""
    stopped: bool = False
    """True when should_stop() ended SFT before sft.steps (Ctrl-C, SIGTERM)."""
    filter: PromptFilter | None = None
    """The filter that skipped records that do not fit (its `skipped` count)."""
    resumed: dict[str, Any] | None = None
    """The state.json of the checkpoint SFT continued from; None when it started at step 0."""
    checkpoint: Path | None = None
    """The last checkpoint written (None: none)."""


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
    checkpoints: SFTCheckpointing | None = None,
) -> SFTResult:
    """The supervised warm start of a RunConfig (its [sft] section). Uses a copy of the task stream seeded apart
    from the RL stream. `demonstrate`: a multi-turn run's worked episodes (`Environment.demonstration`), whose
    observations are masked out of the loss; None = the examples' answers. `should_stop` is asked after every
    step (the loop's signal flag): when it says so, SFT ends after the step it finished, its last metrics are
    logged, a checkpoint is written (with `checkpoints`), and the result says `stopped`.

    checkpoints: resumable checkpoints every `every` steps and at a stop; with `resume_from`, SFT continues from
    that checkpoint's step, weights, optimizer state and data position: the weights it ends with are the bits an
    uninterrupted SFT ends with."""
    s = cfg.sft
    # The warm start keeps its optimizer state where the run's does (train.offload): a plan that fits only with
    # offload must hold during SFT too.
    opt = MasterAdamW(
        model,
        lr=s.lr,
        betas=tuple(cfg.train.betas),
        weight_decay=cfg.train.weight_decay,
        offload=cfg.train.offload,
    )
    sft_task = copy.deepcopy(task)  # its cursor is the SFT stream's data position (saved with a checkpoint)
    res = SFTResult()
    # A record that does not fit is skipped and named (file:line), as in RL; sequences must also fit a microbatch.
    limit = min(cfg.engine.max_model_len, cfg.train.max_tokens_per_microbatch)
    if demonstrate is not None:  # a worked episode is held to the episode's limit, as the RL episodes are
        limit = min(limit, episode_token_limit(cfg))
    res.filter = PromptFilter(cfg.task.max_prompt_tokens, limit, cfg.sampling.max_tokens, log=out)
    start = 0
    if checkpoints is not None and checkpoints.resume_from is not None:
        st = load_checkpoint(checkpoints.resume_from, model=model, optimizers={"sft": opt})
        start = res.steps_done = int(st["sft_step"])
        sft_task.load_state_dict(st["task"])
        res.filter.skipped = int(st.get("skipped_prompts", 0))
        res.resumed = st
        out(f"SFT: continuing from step {start} of {s.steps} ({checkpoints.resume_from})")
    stream = sft_task.train_examples(seed=cfg.run.seed + SFT_SEED_OFFSET)
    max_skips = 2 * getattr(task, "num_train", 5_000) + 1
    batches = sft_batches(stream, encode, tok, s.batch_size, res.filter, max_skips, demonstrate)
    bar = progress_bar(s.steps - start, "sft", enabled=cfg.run.progress)
    for step, (prompts, completions, masks) in enumerate(batches, start=start):
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
        # No checkpoint after the last step: the loop writes sft/ then, and these are removed.
        due = checkpoints is not None and checkpoints.every and res.steps_done % checkpoints.every == 0
        if checkpoints is not None and res.steps_done < s.steps and (stop or due):
            res.checkpoint = _save_sft_checkpoint(checkpoints, model, opt, sft_task, res)
        if stop:
            res.stopped = True
            break
    bar.close()
    return res


def _save_sft_checkpoint(
    ck: SFTCheckpointing, model: CausalLM, opt: MasterAdamW, sft_task: Any, res: SFTResult
) -> Path:
    """`sft-checkpoints/step-N`: weights, the SFT optimizer, the SFT stream's cursor; written by rank 0, the
    others wait (every rank trains the same SFT on the same data, so rank 0's files are every rank's state)."""
    path = ck.root / f"step-{res.steps_done:06d}"
    if ck.write:
        state = {
            "sft_step": res.steps_done,
            "task": sft_task.state_dict(),
            "skipped_prompts": res.filter.skipped if res.filter is not None else 0,
            "summary": ck.extra_state(),
        }
        path = save_checkpoint(
            ck.root,
            res.steps_done,
            model=model,
            tokenizer=ck.tokenizer,
            optimizers={"sft": opt},
            state=state,
            keep=ck.keep,
        )
    ck.barrier()
    return path


def write_sft_model(
    model: CausalLM, tok: Tokenizer, sft_dir: Path, *, steps_done: int, steps: int, extra: dict[str, Any]
) -> None:
    """sft/ (HF checkpoint) with sft_state.json, assembled beside it and renamed into place: a crash leaves the
    old sft/ or the new one, never half of one."""
    tmp = sft_dir.with_name(sft_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_model(model, tmp, tokenizer=tok)
    state = {"steps_done": steps_done, "steps": steps, "finished": steps_done >= steps, **extra}
    (tmp / SFT_STATE).write_text(json.dumps(state) + "\n")
    if sft_dir.exists():
        shutil.rmtree(sft_dir)
    os.replace(tmp, sft_dir)


def read_sft_state(sft_dir: Path) -> dict[str, Any] | None:
    """sft/sft_state.json, or None when sft/ has none (no sft/, or one an older exactrl wrote)."""
    f = sft_dir / SFT_STATE
    if not f.is_file():
        return None
    try:
        d = json.loads(f.read_text())
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


@dataclass
class SFTResumePoint:
    """Where `--resume` of a run without an RL checkpoint stands with its SFT."""

    finished: dict[str, Any] | None = None
    """sft/sft_state.json of an SFT that finished: its weights are sft/, SFT is not run again."""
    checkpoint: Path | None = None
    """The SFT checkpoint to continue from."""
    state: dict[str, Any] = field(default_factory=dict)
    """That checkpoint's state.json (read when it is checked)."""


def sft_resume_point(out_dir: Path) -> SFTResumePoint:
    """Finished SFT (sft/ says so), an SFT checkpoint to continue from, or nothing to resume (SFT starts at
    step 0). sft/ weights of unknown progress with no checkpoint are refused (ValueError): starting SFT over
    would overwrite them."""
    sft_dir = out_dir / "sft"
    state = read_sft_state(sft_dir)
    if state is not None and state.get("finished"):
        return SFTResumePoint(finished=state)
    ckpt = latest_checkpoint(out_dir / SFT_CHECKPOINTS)
    if ckpt is not None:
        return SFTResumePoint(checkpoint=ckpt)
    if sft_dir.exists():
        how_far = (
            f"{state.get('steps_done')} of {state.get('steps')} steps"
            if state
            else "an unknown number of steps"
        )
        raise ValueError(
            f"{sft_dir} holds SFT weights ({how_far}) and there is no SFT checkpoint under "
            f"{out_dir / SFT_CHECKPOINTS} to continue from: --resume would start SFT over and overwrite them. "
            f"Start RL from them with --set sft.steps=0 --set sft.checkpoint={sft_dir} --allow-config-change, or "
            "start the run over with --overwrite"
        )
    return SFTResumePoint()


def truncate_sft_log(paths: Iterable[Path], keep_steps: int | None) -> None:
    """On a resume during (or right after) SFT: keep the SFT records of the steps the weights hold (sft_step <
    keep_steps; None = every SFT record) and drop the rest (later SFT steps, the evaluation before RL, RL steps):
    they are logged again by the resumed run."""
    for path in paths:
        if not path.exists():
            continue
        keep = []
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if "sft_step" in rec and (keep_steps is None or rec["sft_step"] < keep_steps):
                keep.append(line)
        path.write_text("".join(k + "\n" for k in keep))


__all__ = [
    "SFT_CHECKPOINTS",
    "SFTCheckpointing",
    "SFTResult",
    "SFTResumePoint",
    "batch_iter",
    "demonstration_tokens",
    "run_sft",
    "read_sft_state",
    "sft_batches",
    "sft_resume_point",
    "sft_step",
    "sft_tokens",
    "truncate_sft_log",
    "write_sft_model",
]
