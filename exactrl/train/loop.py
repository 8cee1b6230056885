"""`exactrl train`: rollout (engine) -> rewards -> advantages -> train step -> repeat, colocated on one device.

The engine and the trainer hold the *same* model object: after each optimizer step the next `generate` samples
from the new weights with no file round trip. In exact mode the first minibatch of every step re-derives the
rollout logprobs through the training path and logs how many differ (`mismatch/num_mismatched_tokens`, which is 0).
"""

from __future__ import annotations

import copy
import json
import math
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from exactrl.algorithms import advantage_metrics, grpo_advantages, reward_metrics, rloo_advantages
from exactrl.config import RunConfig, save_config
from exactrl.engine.engine import EngineConfig, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.model.loading import load_policy, resolve_device
from exactrl.model.qwen import CausalLM
from exactrl.model.tokenizer import Tokenizer
from exactrl.ops import set_exact_environment
from exactrl.tasks import Example, RewardComputer, load_chat_template, make_task, render_prompt
from exactrl.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from exactrl.train.critic import ValueModel
from exactrl.train.logging import MetricsLogger, step_line
from exactrl.train.optim import MasterAdamW, lr_factor, set_lr
from exactrl.train.sft import batch_iter, sft_step, sft_tokens
from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings


class _StopFlag:
    """Ctrl-C sets the flag: the current step finishes, a checkpoint is written, the run exits cleanly."""

    def __init__(self) -> None:
        self.stop = False
        self._old = None

    def __enter__(self) -> _StopFlag:
        def handler(signum, frame):
            if self.stop:  # a second Ctrl-C: give up waiting
                raise KeyboardInterrupt
            self.stop = True
            print(
                "\nCtrl-C: finishing this step, then writing a checkpoint (Ctrl-C again to abort)", flush=True
            )

        try:
            self._old = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread
            self._old = None
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def build_task(cfg: RunConfig):
    t = cfg.task
    if t.name == "arithmetic":
        return make_task(
            "arithmetic",
            max_operand=t.arithmetic_max_operand,
            ops=t.arithmetic_ops,
            num_terms=t.arithmetic_num_terms,
            seed=cfg.run.seed,
        )
    return make_task(
        "jsonl",
        path=t.path,
        eval_path=t.eval_path,
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        num_eval=t.num_eval,
        seed=cfg.run.seed,
    )


@dataclass
class PromptEncoder:
    """Turns task prompts into model input ids (chat template when configured and available)."""

    tokenizer: Tokenizer
    chat_template: str | None
    system_prompt: str | None

    def __call__(self, ex: Example) -> list[int]:
        text = render_prompt(ex.prompt, chat_template=self.chat_template, system_prompt=self.system_prompt)
        return self.tokenizer.encode(text)


def make_encoder(cfg: RunConfig, tok: Tokenizer) -> PromptEncoder:
    template = None
    if cfg.task.use_chat_template:
        template = tok.chat_template
        if template is None and cfg.model.path:
            template = load_chat_template(cfg.model.path)
    return PromptEncoder(tok, template, cfg.task.system_prompt)


def evaluate(
    engine: RolloutEngine,
    tok: Tokenizer,
    encode: PromptEncoder,
    examples: list[Example],
    rewards: RewardComputer,
    *,
    samples: int = 1,
    temperature: float = 0.0,
    max_tokens: int = 64,
    seed: int = 0,
    stop: list[str] | None = None,
    stop_token_ids: list[int] | None = None,
) -> dict[str, float]:
    """Accuracy (mean reward > 0.5 of the first sample, greedy by default) and pass@k over held-out examples."""
    if not examples:
        return {}
    ids = [encode(ex) for ex in examples]
    params = SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        n=samples,
        seed=seed + 7_777_777,
        stop_token_ids=sorted(set(tok.stop_token_ids) | set(stop_token_ids or [])),
        stop=list(stop or []),
    )
    outs = engine.generate(ids, params, request_ids=list(range(len(ids))))
    completions, answers, exs = [], [], []
    for ex, out in zip(examples, outs):
        for s in out.samples:
            completions.append(tok.decode(s.token_ids))
            answers.append(ex.answer)
            exs.append(ex)
    res = rewards(completions, answers, exs)
    r = torch.tensor(res.rewards).view(len(examples), samples)
    correct = r > 0.5
    out = {
        "eval/accuracy": float(correct[:, 0].float().mean()),
        "eval/reward": float(r.mean()),
        "eval/num_examples": float(len(examples)),
    }
    if samples > 1:
        out[f"eval/pass@{samples}"] = float(correct.any(1).float().mean())
        out["eval/mean_accuracy"] = float(correct.float().mean())
    return out


def run_sft(
    cfg: RunConfig, model: CausalLM, tok: Tokenizer, encode: PromptEncoder, task, log
) -> dict[str, float]:
    """The supervised warm start. Uses a copy of the task stream seeded apart from the RL stream."""
    s = cfg.sft
    opt = MasterAdamW(model, lr=s.lr, betas=tuple(cfg.train.betas), weight_decay=cfg.train.weight_decay)
    stream = copy.deepcopy(task).train_examples(seed=cfg.run.seed + 1_000_003)
    last: dict[str, float] = {}
    from tqdm import tqdm

    bar = tqdm(total=s.steps, desc="sft", disable=not cfg.run.progress, leave=False)
    for step, batch in enumerate(batch_iter(stream, s.batch_size)):
        if step >= s.steps:
            break
        set_lr(
            opt, s.lr * lr_factor(step, warmup_steps=s.warmup_steps, total_steps=s.steps, schedule="cosine")
        )
        pairs = [(encode(ex), sft_tokens(tok, "", ex.answer)[1]) for ex in batch]
        last = sft_step(
            model,
            opt,
            [p for p, _ in pairs],
            [c for _, c in pairs],
            max_tokens_per_microbatch=cfg.train.max_tokens_per_microbatch,
            grad_clip=cfg.train.grad_clip,
        )
        bar.update(1)
        bar.set_postfix(loss=f"{last['sft/loss']:.3f}")
        if step % 25 == 0 or step == s.steps - 1:
            log({"sft_step": step, **last})
    bar.close()
    return last


def train(cfg: RunConfig, resume: bool = False, out=print) -> dict[str, Any]:
    """Run the whole job described by cfg; returns the summary written to summary.json."""
    t0 = time.perf_counter()
    cfg.validate()
    out_dir = Path(cfg.run.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir / "config.toml")
    device = resolve_device(cfg.run.device)
    exact = cfg.run.exact
    set_exact_environment(exact)
    torch.manual_seed(cfg.run.seed)
    if exact:
        torch.use_deterministic_algorithms(True, warn_only=True)

    model, tok = load_policy(
        preset_name=cfg.model.preset,
        path=cfg.model.path,
        device=device,
        dtype=cfg.model.dtype,
        exact=exact,
        fp32_lm_head=cfg.model.fp32_lm_head,
        seed=cfg.run.seed,
        tokenizer_path=cfg.model.tokenizer,
    )
    task = build_task(cfg)
    encode = make_encoder(cfg, tok)
    rewards = RewardComputer(cfg.reward.functions, cfg.reward.weights or None, cfg.reward.timeout_s)
    # The [engine] section's fields are a subset of the engine's own config: passed through by name.
    engine = RolloutEngine(model, EngineConfig(**asdict(cfg.engine)), tokenizer=tok)
    ckpt_root = out_dir / "checkpoints"
    resume_from = latest_checkpoint(ckpt_root) if resume else None
    if resume and resume_from is None:
        out(f"no checkpoint under {ckpt_root}: starting from scratch")
    # With nothing to resume from the run starts over, and so does its metrics.jsonl.
    logger = MetricsLogger(out_dir, tensorboard=cfg.run.tensorboard, resume=resume_from is not None)

    def fits(ids: list[int]) -> bool:
        return (
            len(ids) <= cfg.task.max_prompt_tokens
            and len(ids) + cfg.sampling.max_tokens <= cfg.engine.max_model_len
        )

    # Too-long held-out prompts are left out like too-long training prompts (the engine would reject them).
    all_eval = task.eval_examples(cfg.task.num_eval)
    eval_examples = [ex for ex in all_eval if fits(encode(ex))]
    if len(eval_examples) < len(all_eval):
        out(
            f"{len(all_eval) - len(eval_examples)} held-out prompts are longer than task.max_prompt_tokens = "
            f"{cfg.task.max_prompt_tokens} tokens: left out of the evaluation"
        )
    ev_kw = dict(
        samples=cfg.task.eval_samples,
        temperature=cfg.task.eval_temperature,
        max_tokens=cfg.sampling.max_tokens,
        seed=cfg.run.seed,
        stop=cfg.sampling.stop,
        stop_token_ids=cfg.sampling.stop_token_ids,
    )

    # ---- SFT warm start (skipped on resume: the checkpoint holds the RL-trained weights) ------------------
    summary: dict[str, Any] = {}
    sft_dir = out_dir / "sft"
    if resume_from is None:
        if cfg.sft.checkpoint:
            from exactrl.model.hf import load_model

            loaded = load_model(cfg.sft.checkpoint, device=device, dtype=model.dtype, exact=exact)
            model.load_state_dict(loaded.state_dict())
        elif cfg.sft.steps > 0:
            out(f"SFT warm start: {cfg.sft.steps} steps of {cfg.sft.batch_size} examples")
            last = run_sft(cfg, model, tok, encode, task, lambda r: logger.log({"step": 0, **r}))
            out(f"SFT done: loss {last.get('sft/loss', float('nan')):.4f}")
            from exactrl.model.hf import save_model

            save_model(model, sft_dir, tokenizer=tok)
        before = evaluate(engine, tok, encode, eval_examples, rewards, **ev_kw)
        summary["accuracy_before_rl"] = before.get("eval/accuracy")
        logger.log({"step": 0, **before, "phase": "before_rl"})
        out(
            f"held-out accuracy before RL: {before.get('eval/accuracy', float('nan')):.3f} "
            f"on {len(eval_examples)} examples"
        )
    elif cfg.algorithm.kl_coef > 0 and (cfg.sft.checkpoint or cfg.sft.steps > 0):
        # Resuming: the KL reference is the model RL started from (after SFT), not the initial weights. Put it in
        # place before the reference copy is taken below; the checkpoint then overwrites the policy's weights.
        from exactrl.model.hf import load_model

        loaded = load_model(cfg.sft.checkpoint or sft_dir, device=device, dtype=model.dtype, exact=exact)
        model.load_state_dict(loaded.state_dict())

    # ---- RL ------------------------------------------------------------------------------------------------
    a, tr = cfg.algorithm, cfg.train
    ref_model = None
    if a.kl_coef > 0:
        ref_model = copy.deepcopy(model).requires_grad_(False)
    critic = critic_opt = None
    if a.name == "ppo":
        critic = ValueModel.from_policy(model, init_from_policy=True, seed=cfg.run.seed)
        critic_opt = MasterAdamW(critic, lr=tr.critic_lr, betas=tuple(tr.betas), weight_decay=tr.weight_decay)
    opt = MasterAdamW(model, lr=tr.lr, betas=tuple(tr.betas), weight_decay=tr.weight_decay)
    settings = TrainerSettings(
        algorithm=a.name,
        temperature=cfg.sampling.temperature if cfg.sampling.temperature > 0 else 1.0,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        dual_clip=a.dual_clip,
        aggregation=a.aggregation,
        ppo_epochs=a.ppo_epochs,
        minibatches=a.minibatches_per_rollout,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_kind,
        kl_in_reward=a.kl_in_reward,
        entropy_coef=a.entropy_coef,
        gamma=a.gamma,
        lam=a.lam,
        value_clip=a.value_clip,
        vf_coef=a.vf_coef,
        rollout_correction=a.rollout_correction,
        rollout_correction_threshold=a.rollout_correction_threshold,
        max_tokens_per_microbatch=tr.max_tokens_per_microbatch,
        cuda_graphs=tr.cuda_graphs,
        grad_clip=tr.grad_clip,
        exact=exact,
        norm_constant=float(cfg.sampling.max_tokens),
        seed=cfg.run.seed,
    )
    if a.rollout_correction and exact:
        import warnings

        warnings.warn(
            "algorithm.rollout_correction is set in exact mode, where rollout and trainer logprobs are "
            "bitwise equal: the correction is a no-op",
            stacklevel=1,
        )
    trainer = PolicyTrainer(
        model, settings, opt, ref_model=ref_model, critic=critic, critic_optimizer=critic_opt
    )
    optimizers = {"policy": opt} | ({"critic": critic_opt} if critic_opt is not None else {})

    start_step = 0
    totals = {"compared": 0, "mismatched": 0, "skipped_prompts": 0, "reward_errors": 0, "nan_steps": 0}
    if resume_from is not None:
        state = load_checkpoint(resume_from, model=model, optimizers=optimizers, critic=critic)
        start_step = state["step"]
        task.load_state_dict(state["task"])
        totals.update(state.get("totals", {}))
        summary.update(state.get("summary", {}))
        trainer.steps_done = start_step
        logger.truncate_after(start_step)
        out(f"resumed from {resume_from} at step {start_step}")

    stream = task.train_examples(seed=cfg.run.seed)
    sampling = cfg.sampling
    prompts_per_step = a.prompts_per_step
    # Two passes over a finite training set with no prompt that fits means none ever will.
    max_skips_in_a_row = 2 * getattr(task, "num_train", 5_000) + 1
    consecutive_nan = 0
    step = start_step
    stopped_early = False
    from tqdm import tqdm

    with _StopFlag() as flag:
        while step < tr.steps:
            t_step = time.perf_counter()
            set_lr(
                opt,
                tr.lr
                * lr_factor(
                    step, warmup_steps=tr.warmup_steps, total_steps=tr.steps, schedule=tr.lr_schedule
                ),
            )
            if critic_opt is not None:
                set_lr(
                    critic_opt,
                    tr.critic_lr
                    * lr_factor(
                        step, warmup_steps=tr.warmup_steps, total_steps=tr.steps, schedule=tr.lr_schedule
                    ),
                )
            # -- prompts (too-long ones are skipped and counted, not a crash) ------------------------------
            examples, prompt_ids = [], []
            skipped_in_a_row = 0
            while len(examples) < prompts_per_step:
                ex = next(stream)
                ids = encode(ex)
                if not fits(ids):
                    totals["skipped_prompts"] += 1
                    skipped_in_a_row += 1
                    if skipped_in_a_row >= max_skips_in_a_row:  # e.g. every prompt is too long: never hang
                        raise ValueError(
                            f"{skipped_in_a_row} training prompts in a row are longer than task.max_prompt_tokens "
                            f"= {cfg.task.max_prompt_tokens} tokens: raise it (and engine.max_model_len), or check "
                            "task.prompt_field and the chat template"
                        )
                    continue
                skipped_in_a_row = 0
                examples.append(ex)
                prompt_ids.append(ids)
            # -- rollout ------------------------------------------------------------------------------------
            t_gen = time.perf_counter()
            params = SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                n=a.group_size,
                seed=cfg.run.seed,
                stop=list(sampling.stop),
                stop_token_ids=sorted(set(tok.stop_token_ids) | set(sampling.stop_token_ids)),
            )
            base_id = step * prompts_per_step
            bar = tqdm(
                total=len(prompt_ids) * a.group_size,
                desc=f"step {step + 1} generate",
                leave=False,
                disable=not cfg.run.progress,
            )
            outs = engine.generate(
                prompt_ids,
                params,
                request_ids=[base_id + i for i in range(len(prompt_ids))],
                progress=bar.update,
            )
            bar.close()
            gen_s = time.perf_counter() - t_gen
            # -- rewards ------------------------------------------------------------------------------------
            rollouts: list[Rollout] = []
            completions, answers, exs = [], [], []
            for ex, ids, o in zip(examples, prompt_ids, outs):
                if o.error is not None or len(o.samples) != a.group_size:
                    # The engine refused this prompt (e.g. it can never fit the KV cache): skip its group,
                    # count it, and train on the others.
                    totals["skipped_prompts"] += 1
                    out(f"step {step + 1}: prompt skipped by the engine: {o.error}")
                    continue
                for smp in o.samples:
                    rollouts.append(
                        Rollout(
                            prompt_ids=ids,
                            completion_ids=smp.token_ids,
                            rollout_logprobs=smp.rollout_logprobs,
                            truncated=smp.finish_reason == "length",
                        )
                    )
                    completions.append(tok.decode(smp.token_ids))
                    answers.append(ex.answer)
                    exs.append(ex)
            if not rollouts:
                raise RuntimeError(
                    f"step {step + 1}: the engine refused every prompt of the step ({outs[0].error}); "
                    "check engine.num_kv_blocks / engine.max_model_len against the prompt lengths"
                )
            res = rewards(completions, answers, exs)
            r = torch.tensor(res.rewards, dtype=torch.float32)
            if a.name == "rloo":
                adv = rloo_advantages(r, a.group_size)
            else:
                adv = grpo_advantages(r, a.group_size, scale="none" if a.name == "dr_grpo" else a.adv_scale)
            for ro, rew, ad in zip(rollouts, r.tolist(), adv.tolist()):
                ro.reward, ro.advantage = rew, ad
            # -- train --------------------------------------------------------------------------------------
            t_train = time.perf_counter()
            bar = tqdm(total=1, desc=f"step {step + 1} train", leave=False, disable=not cfg.run.progress)
            m = trainer.step(rollouts)
            bar.update(1)
            bar.close()
            train_s = time.perf_counter() - t_train
            step += 1
            # -- metrics ------------------------------------------------------------------------------------
            lengths = torch.tensor([len(ro.completion_ids) for ro in rollouts], dtype=torch.float32)
            per_fn = {k: torch.tensor(v, dtype=torch.float32) for k, v in res.per_function.items()}
            m.update(reward_metrics(r, a.group_size, per_fn))
            if a.name != "ppo":  # PPO's token-level GAE advantages are logged by the trainer
                m.update(advantage_metrics(adv[:, None], torch.ones(len(adv), 1)))
            from exactrl.algorithms import response_length_metrics

            m.update(response_length_metrics(lengths, torch.tensor([ro.truncated for ro in rollouts])))
            m["train/accuracy"] = float((r > 0.5).float().mean())
            errs = sum(res.num_errors.values()) + sum(res.num_timeouts.values())
            totals["reward_errors"] += errs
            m["reward/errors"] = float(errs)
            m["prompts/skipped_total"] = float(totals["skipped_prompts"])
            ntok = float(lengths.sum())
            m["perf/generate_s"], m["perf/train_s"] = gen_s, train_s
            m["perf/step_s"] = time.perf_counter() - t_step
            m["perf/tokens_per_s"] = ntok / max(gen_s, 1e-9)
            m["step"] = step
            if "mismatch/num_tokens" in m:
                totals["compared"] += int(m["mismatch/num_tokens"])
                totals["mismatched"] += int(m["mismatch/num_mismatched_tokens"])
            if m.get("nan_skipped", 0) > 0:
                consecutive_nan += 1
                totals["nan_steps"] += 1
                out(f"step {step}: non-finite loss or gradient, update skipped ({consecutive_nan} in a row)")
            else:
                consecutive_nan = 0
            if cfg.task.eval_every and step % cfg.task.eval_every == 0 and step < tr.steps:
                m.update(evaluate(engine, tok, encode, eval_examples, rewards, **ev_kw))
            logger.log(m)
            if step % cfg.run.log_every == 0:
                out(step_line(m))
            if tr.max_nan_steps and consecutive_nan >= tr.max_nan_steps:
                raise RuntimeError(
                    f"{consecutive_nan} consecutive steps had a non-finite loss or gradient; stopping "
                    f"(train.max_nan_steps = {tr.max_nan_steps}). Lower train.lr or check the rewards."
                )
            if (tr.save_every and step % tr.save_every == 0) or step == tr.steps or flag.stop:
                save_checkpoint(
                    ckpt_root,
                    step,
                    model=model,
                    tokenizer=tok,
                    optimizers=optimizers,
                    critic=critic,
                    keep=tr.keep_checkpoints,
                    state={"task": task.state_dict(), "totals": totals, "summary": summary},
                )
            if flag.stop:
                stopped_early = step < tr.steps
                out(f"stopped at step {step}; resume with --resume")
                break

    after = evaluate(engine, tok, encode, eval_examples, rewards, **ev_kw)
    logger.log({"step": step, **after, "phase": "after_rl"})
    logger.close()
    summary.update(
        {
            "accuracy_after_rl": after.get("eval/accuracy"),
            "rl_steps": step,
            "minutes": (time.perf_counter() - t0) / 60.0,
            "mismatched_tokens_total": totals["mismatched"],
            "compared_tokens_total": totals["compared"],
            "skipped_prompts_total": totals["skipped_prompts"],
            "reward_errors_total": totals["reward_errors"],
            "nan_steps_total": totals["nan_steps"],
            "exact": exact,
            "algorithm": a.name,
            "stopped_early": stopped_early,
        }
    )
    if summary.get("accuracy_before_rl") is not None and summary.get("accuracy_after_rl") is not None:
        summary["accuracy_gain"] = summary["accuracy_after_rl"] - summary["accuracy_before_rl"]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        from exactrl.report import draw_report

        draw_report(out_dir)
    except ImportError as err:  # matplotlib missing: the numbers are in metrics.jsonl anyway
        out(f"report.png not drawn ({err})")
    out(_summary_text(summary, out_dir))
    return summary


def _summary_text(s: dict[str, Any], out_dir: Path) -> str:
    def pct(x):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}%"

    return (
        f"\n== {s['algorithm']} ({'exact' if s['exact'] else 'fast'} mode): {s['rl_steps']} RL steps in "
        f"{s['minutes']:.1f} min\n"
        f"   held-out accuracy {pct(s.get('accuracy_before_rl'))} -> {pct(s.get('accuracy_after_rl'))}\n"
        f"   rollout vs trainer logprobs: {s['mismatched_tokens_total']} of {s['compared_tokens_total']} tokens differ\n"
        f"   outputs in {out_dir}/ (metrics.jsonl, report.png, checkpoints/, summary.json)"
    )
