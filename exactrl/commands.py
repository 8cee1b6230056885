"""CLI commands that run jobs: train, sft, eval, bench, report (registered into exactrl.cli's parser)."""

from __future__ import annotations

import argparse
import json


def cmd_train(args) -> int:
    from exactrl.config import load_config
    from exactrl.train.loop import train

    cfg = load_config(args.config, args.set or [])
    train(cfg, resume=args.resume)
    return 0


def cmd_sft(args) -> int:
    """SFT only: the warm start of the config, then save the checkpoint and evaluate."""
    from exactrl.config import load_config
    from exactrl.train.loop import train

    cfg = load_config(args.config, (args.set or []) + ["train.steps=0"])
    if cfg.sft.steps <= 0:
        raise ValueError("sft.steps is 0 in this config: nothing to train (set --set sft.steps=N)")
    train(cfg)
    return 0


def cmd_eval(args) -> int:
    from exactrl.config import load_config
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.model.loading import load_policy
    from exactrl.tasks import RewardComputer
    from exactrl.train.loop import build_task, evaluate, make_encoder

    # model.preset=none: --model replaces the config's model, which may be a preset (exactly one may be set)
    overrides = list(args.set or []) + ["model.preset=none", f"model.path={args.model}"]
    if args.task:  # else the config's task (arithmetic without a config)
        overrides.append(f"task.name={args.task}")
    if args.data:
        overrides += [f"task.path={args.data}", "task.eval_path=none"]
    cfg = load_config(args.config, overrides) if args.config else load_config(None, overrides)
    model, tok = load_policy(
        path=args.model, device=args.device, dtype=cfg.model.dtype, exact=args.mode == "exact"
    )
    num = args.num or cfg.task.num_eval
    # Every record of --data is an eval example (a JsonlTask would hold most of them out for training).
    if args.data:
        from exactrl.tasks import load_jsonl

        examples = load_jsonl(args.data, cfg.task.prompt_field, cfg.task.answer_field)[:num]
    else:
        examples = build_task(cfg).eval_examples(num)
    rewards = RewardComputer(cfg.reward.functions, cfg.reward.weights or None, cfg.reward.timeout_s)
    engine = RolloutEngine(model, EngineConfig(block_size=cfg.engine.block_size), tokenizer=tok)
    res = evaluate(
        engine,
        tok,
        make_encoder(cfg, tok),
        examples,
        rewards,
        samples=args.samples,
        # pass@k with greedy decoding would draw k identical samples: sample at T=1 unless told otherwise
        temperature=args.temperature if (args.samples == 1 or args.temperature > 0) else 1.0,
        max_tokens=args.max_tokens,
        seed=cfg.run.seed,
        stop=cfg.sampling.stop,  # as train's held-out evaluation does
        stop_token_ids=cfg.sampling.stop_token_ids,
    )
    print(json.dumps(res) if args.json else "\n".join(f"{k}: {v:.4f}" for k, v in res.items()))
    return 0


def cmd_report(args) -> int:
    from exactrl.report import draw_report

    print(draw_report(args.run_dir, args.out))
    return 0


def cmd_bench(args) -> int:
    from exactrl import bench

    return bench.main(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run an RL job from a TOML config")
    p.add_argument("config")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of the run")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("sft", help="supervised warm start only (the config's [sft] section)")
    p.add_argument("config")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    p.set_defaults(func=cmd_sft)

    p = sub.add_parser("eval", help="accuracy and pass@k of a checkpoint on held-out prompts")
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument(
        "--task", choices=["arithmetic", "jsonl"], help="default: the --config's task, else arithmetic"
    )
    p.add_argument("--data", help="JSONL file for --task jsonl")
    p.add_argument("--config", help="take task/reward settings from this TOML config")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE")
    p.add_argument("--samples", type=int, default=1, help="samples per prompt (pass@k with k = samples)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num", type=int, default=0, help="number of held-out examples (0 = task.num_eval)")
    p.add_argument("--device", default="auto")
    p.add_argument("--mode", default="exact", choices=["exact", "fast"])
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="draw a run's curves to a PNG")
    p.add_argument("run_dir")
    p.add_argument("--out", help="output PNG (default RUN_DIR/report.png)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("bench", help="benchmarks: rollout (engine tok/s) or train (tok/s, MFU)")
    p.add_argument("what", choices=["rollout", "train"])
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--model", help="HF checkpoint directory instead of a preset")
    p.add_argument("--mode", default="exact", choices=["exact", "fast"])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--tokens-per-microbatch", type=int, default=8192)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--graphs", default="on", choices=["on", "off"], help="train: replay the step from CUDA graphs"
    )
    p.add_argument("--vs", choices=["hf"], help="also run transformers on the same weights and data")
    p.add_argument("--out-dir", default="benchmarks/results", help="where the JSON line is kept")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)
