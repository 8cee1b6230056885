"""The part of a run before RL: the SFT warm start (from its last checkpoint when resuming) and the held-out
accuracy before RL. `RLRun` (exactrl/train/loop.py) inherits these methods; they use the run's model, task,
encoder, logger and clock as `RLRun.__init__` set them."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

from exactrl.distributed.shared_fs import check_every_rank_sees
from exactrl.train.checkpoint import check_resumable
from exactrl.train.sft import SFT_CHECKPOINTS, SFTCheckpointing, run_sft, write_sft_model


class WarmStart:
    """`RLRun`'s stages before RL (mixed into it)."""

    cfg: Any
    model: Any
    # What `RLRun.__init__` sets (and its methods these call): declared for the type checker.
    clock: Any
    device: Any
    dist: Any
    encode: Any
    env: Any
    eval_examples: Any
    evaluate: Any
    exact: Any
    logger: Any
    out: Any
    out_dir: Any
    resume_from: Any
    rewards: Any
    sft_point: Any
    stop_requested: Any
    summary: Any
    task: Any
    tok: Any
    weights: Any

    def check_resume_point(self) -> None:
        """Refuse, before the run directory changes, a resume whose checkpoint cannot load into this run:
        another model shape (a --allow-config-change of model.*), LoRA or critic that the checkpoint lacks or
        has, a truncated or corrupt file. The run's time so far comes from the checkpoint (RunClock)."""
        cfg = self.cfg
        if self.resume_from is not None:
            check_resumable(self.resume_from, self.model, critic=cfg.algorithm.needs_critic, lora=cfg.lora)
            sft_src = cfg.sft.checkpoint or (self.out_dir / "sft" if cfg.sft.steps > 0 else None)
            if cfg.algorithm.kl_coef > 0 and sft_src:
                check_every_rank_sees(self.dist, Path(sft_src), "the KL reference")
            if cfg.algorithm.kl_coef > 0 and sft_src and not (Path(sft_src) / "config.json").is_file():
                raise ValueError(
                    f"cannot resume: the KL reference is the model after SFT, and {sft_src} holds none "
                    "(no config.json)"
                )
        elif self.sft_point.checkpoint is not None:
            self.sft_point.state = check_resumable(self.sft_point.checkpoint, self.model)
            self.clock.resume_from(self.sft_point.state.get("summary", {}))
        elif self.sft_point.finished is not None:
            self.clock.resume_from(self.sft_point.finished)

    def warm_start(self) -> None:
        """SFT warm start and the held-out accuracy before RL (skipped on resume: the checkpoint holds the
        RL-trained weights, but the KL reference must still be the model RL started from)."""
        cfg, model = self.cfg, self.model
        sft_dir = self.out_dir / "sft"
        if self.resume_from is None:
            if cfg.sft.checkpoint:
                from exactrl.model.hf import load_model

                loaded = load_model(
                    cfg.sft.checkpoint, device=self.device, dtype=model.dtype, exact=self.exact
                )
                model.load_state_dict(loaded.state_dict())
            elif self.sft_point.finished is not None:
                # SFT finished in an earlier invocation that stopped before its first RL checkpoint.
                from exactrl.model.hf import load_model

                loaded = load_model(sft_dir, device=self.device, dtype=model.dtype, exact=self.exact)
                model.load_state_dict(loaded.state_dict())
                done = self.sft_point.finished
                # The run's time up to SFT's end, from the invocation that ran it (the summary splits SFT from RL).
                self.summary["sft_elapsed_s"] = float(done.get(self.clock.KEY, 0.0))
                if done.get("skipped_prompts"):
                    self.summary["sft_skipped_prompts_total"] = done["skipped_prompts"]
                self.out(
                    f"resume: SFT finished earlier ({done.get('steps_done')} steps): its weights from {sft_dir}"
                )
            elif cfg.sft.steps > 0:
                self.sft_warm_start(sft_dir)
                if self.stopped_in_sft:
                    return
            self.weights.push(list(model.named_parameters()))  # disaggregated: the generators' first weights
            before = self.evaluate()
            self.summary["accuracy_before_rl"] = before.get("eval/accuracy")
            self.logger.log({"step": 0, **before, "phase": "before_rl"})
            acc = before.get("eval/accuracy")
            unjudged = not cfg.env.name and self.rewards is not None and self.rewards.accuracy_fn is None
            acc_s = (
                f"{acc:.3f}" if acc is not None else "n/a (no correctness function)" if unjudged else "n/a"
            )
            self.out(f"held-out accuracy before RL: {acc_s} on {len(self.eval_examples)} examples")
        elif cfg.algorithm.kl_coef > 0 and (cfg.sft.checkpoint or cfg.sft.steps > 0):
            # Resuming: put the post-SFT weights in place before the reference copy is taken in build_trainer;
            # the checkpoint then overwrites the policy's weights.
            from exactrl.model.hf import load_model

            loaded = load_model(
                cfg.sft.checkpoint or sft_dir, device=self.device, dtype=model.dtype, exact=self.exact
            )
            model.load_state_dict(loaded.state_dict())

    def sft_warm_start(self, sft_dir: Path) -> None:
        """Run SFT (from its last checkpoint when resuming), checkpointing every sft.save_every steps and at a
        stop; write sft/ (the weights and how far SFT got). A finished SFT's checkpoints are removed."""
        cfg, model = self.cfg, self.model
        ck = SFTCheckpointing(
            root=self.out_dir / SFT_CHECKPOINTS,
            tokenizer=self.tok,
            every=cfg.sft.save_every,
            keep=cfg.train.keep_checkpoints,
            resume_from=self.sft_point.checkpoint,
            write=self.dist.is_main,
            barrier=self.dist.barrier,
            extra_state=lambda: {self.clock.KEY: self.clock.total_s()},
        )
        if ck.resume_from is None:
            self.out(f"SFT warm start: {cfg.sft.steps} steps of {cfg.sft.batch_size} examples")
        sft = run_sft(
            cfg,
            model,
            self.tok,
            self.encode,
            self.task,
            lambda r: self.logger.log({"step": 0, **r}),
            should_stop=self.stop_requested,
            out=self.out,
            demonstrate=self.demonstrations(),
            checkpoints=ck,
        )
        if not sft.stopped:  # a stopped SFT says so below
            self.out(f"SFT done: loss {sft.last.get('sft/loss', float('nan')):.4f}")
        # The run's time so far (earlier invocations of a resumed SFT included) is SFT's: RL's minutes start here.
        sft_s = self.clock.total_s()
        self.summary["sft_elapsed_s"] = sft_s  # ends in _s: the tools that compare runs skip timings
        skipped = sft.filter.skipped if sft.filter is not None else 0
        if skipped:
            self.summary["sft_skipped_prompts_total"] = skipped
        if self.dist.is_main:
            extra = {"skipped_prompts": skipped, self.clock.KEY: sft_s}
            write_sft_model(
                model, self.tok, sft_dir, steps_done=sft.steps_done, steps=cfg.sft.steps, extra=extra
            )
            if not sft.stopped:  # sft/ holds the finished SFT: its resume points are of no more use
                shutil.rmtree(ck.root, ignore_errors=True)
        self.dist.barrier()
        if sft.stopped:
            self.stopped_in_sft = True
            self.summary["sft_steps_done"] = sft.steps_done
            self.out(
                f"stopped during SFT after step {sft.steps_done} of {cfg.sft.steps}: `--resume` continues SFT from "
                f"{sft.checkpoint}; the weights so far are also in {sft_dir}"
            )

    def demonstrations(self) -> Any:
        """Multi-turn: the environment's worked episodes for the SFT warm start (tool calls and their results,
        the results masked out of the loss), or None: single-turn, or an environment without `demonstration`,
        whose warm start learns the examples' answers (said in the log)."""
        if self.env is None:
            return None
        env = self.env.make()
        probe = self.task.eval_examples(1) or [next(copy.deepcopy(self.task).train_examples(seed=0))]
        if env.demonstration(probe[0]) is None:
            self.out(
                f"SFT: the environment {self.cfg.env.name!r} has no demonstration(): the warm start learns the "
                "examples' answers as single completions"
            )
            return None
        return env.demonstration
