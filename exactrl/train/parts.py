"""What a run is made of besides the model, built from its config: the task, the prompt encoder, the multi-turn
environment, and the held-out evaluation over them (`RLRun` and `exactrl eval` build the same ones)."""

from __future__ import annotations

from typing import cast

import torch

from exactrl.config import RunConfig, episode_token_limit
from exactrl.engine.engine import RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs.rollout import EnvSetup
from exactrl.model.tokenizer import Tokenizer
from exactrl.tasks import Example, RewardComputer, load_chat_template, make_task
from exactrl.tasks.prompts import PromptEncoder
from exactrl.tasks.rewards import CORRECT_ABOVE
from exactrl.train.stages import env_episodes


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
        t.name,
        path=t.path,
        eval_path=t.eval_path,
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        num_eval=t.num_eval,
        seed=cfg.run.seed,
    )


def make_encoder(cfg: RunConfig, tok: Tokenizer) -> PromptEncoder:
    template = None
    if cfg.task.use_chat_template:
        template = tok.chat_template
        if template is None and cfg.model.path:
            template = load_chat_template(cfg.model.path)
    # The checkpoint's named special tokens (e.g. a Llama template's {{ bos_token }}), then the user's kwargs.
    kwargs = {**getattr(tok, "special_tokens", {}), **dict(cfg.task.chat_template_kwargs)}
    return PromptEncoder(tok, template, cfg.task.system_prompt, kwargs)


def env_setup(cfg: RunConfig, search_dirs: list[str] | None = None) -> EnvSetup:
    """The [env] section as the episode driver takes it (the environment resolved, its options checked)."""
    from exactrl.envs import EpisodeSettings, env_factory

    cls, make = env_factory(cast(str, cfg.env.name), cfg.env.options, search_dirs)  # set: an [env] run
    settings = EpisodeSettings(
        max_turns=cfg.env.max_turns,
        max_tokens_per_turn=cfg.sampling.max_tokens,
        max_episode_tokens=episode_token_limit(cfg),
        timeout_s=cfg.env.timeout_s,
        isolation=cfg.env.isolation,
        workers=cfg.env.workers,
        max_error_share=cfg.env.max_error_share,
    )
    return EnvSetup(cls, make, settings)


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
    env: EnvSetup | None = None,
) -> dict[str, float]:
    """Accuracy and pass@k over held-out examples. Accuracy: the share of samples the correctness function
    (`rewards.accuracy_fn`, reward.accuracy) scores above 0.5, over every sample of every example: with one greedy
    sample (the default) the greedy answers' accuracy; with k samples at T > 0 the mean over them (pass@1 estimated
    from k samples, steadier than the first sample's). Never the summed reward: a format bonus is not a correct
    answer. Without a correctness function the accuracy keys are left out (not reported, rather than invented);
    eval/reward (the summed reward) and eval/reward/<function> are always there.

    env: a multi-turn run's environment. A tool agent is measured with its tool: every example is an episode
    through the environment (tool calls answered, as in training), scored by the environment's reward, whose
    verdict (episode reward > 0.5) is the accuracy, and the episodes' metrics are logged under eval/env/...;
    `rewards` is not used then."""
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
    extra: dict[str, float] = {}
    if env is not None:
        from exactrl.envs.rollout import env_stop

        params.stop = env_stop(params.stop, env.cls)
        eb = env_episodes(engine, tok, examples, ids, env, params, list(range(len(ids))))
        # A prompt the engine refused (no episodes) scores 0 on every sample.
        flat = [g[j].reward if j < len(g) else 0.0 for g in eb.groups for j in range(samples)]
        r = torch.tensor(flat, dtype=torch.float32).view(len(examples), samples)
        extra = {f"eval/{k}": v for k, v in eb.metrics.items()}
        correct: torch.Tensor | None = r > CORRECT_ABOVE  # the environment's verdict
    else:
        outs = engine.generate(ids, params, request_ids=list(range(len(ids))))
        completions, answers, exs = [], [], []
        for ex, req in zip(examples, outs):
            for s in req.samples:
                completions.append(tok.decode(s.token_ids))
                answers.append(ex.answer)
                exs.append(ex)
        res = rewards(completions, answers, exs)
        r = torch.tensor(res.rewards, dtype=torch.float32).view(len(examples), samples)
        extra = {f"eval/reward/{k}": sum(v) / len(v) for k, v in res.per_function.items() if v}
        correct = None if res.correct is None else torch.tensor(res.correct).view(len(examples), samples)
    out = {"eval/reward": float(r.mean()), "eval/num_examples": float(len(examples)), **extra}
    if correct is not None:
        out["eval/accuracy"] = float(correct.float().mean())
        if samples > 1:
            out[f"eval/pass@{samples}"] = float(correct.any(1).float().mean())
            out["eval/mean_accuracy"] = float(correct.float().mean())
    return out
