"""CLI commands that run jobs: train, sft, eval, twin, bench, report, parity --replay (registered into
exactrl.cli's parser)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from exactrl.distributed.nodes import add_nodes_args

# What a command cannot do on several ranks (`--nproc N`, N > 1), refused by the launcher before torchrun starts
# anything (exactrl.cli.check_before_launch): (command, when it applies to the parsed options, why: a text or a
# function of the options). The ranks check again under a plain torchrun. A command that learns to run on ranks
# loses its row here.
NOT_ON_RANKS: list[
    tuple[str, Callable[[argparse.Namespace], bool], str | Callable[[argparse.Namespace], str]]
] = [
    (
        "bench",
        lambda a: a.what == "train" and not a.fsdp,
        "bench train on several ranks measures the FSDP2 step: add --fsdp",
    ),
    (
        "bench",
        lambda a: a.what in ("rollout", "train") and bool(a.vs),
        lambda a: (
            f"bench {a.what}{' --fsdp' if a.fsdp else ''} --vs {a.vs} runs at world size 1; drop --vs or --nproc"
        ),
    ),
    (
        "parity",
        lambda a: bool(a.replay),
        "parity --replay recomputes a report on one process; drop --nproc",
    ),
]


def _run_dir_plan(cfg, args):
    """Check the output dir before anything is written (refusals name the dir and the ways on)."""
    from exactrl.train.rundir import check_run_dir

    plan = check_run_dir(
        cfg,
        resume=getattr(args, "resume", False),
        overwrite=args.overwrite,
        allow_config_change=getattr(args, "allow_config_change", False),
    )
    for note in plan.notes:
        print(note)
    return plan


def _run(cfg, args) -> int:
    """Train, and exit as a shell reports the signal when a signal stopped the run before its end (after its
    checkpoint): 130 after Ctrl-C, 143 after SIGTERM (a scheduler's preemption)."""
    import os

    from exactrl.config import resolve_device
    from exactrl.train.loop import train
    from exactrl.train.preflight import inert_keys
    from exactrl.train.resolved import resolve_run

    main = os.environ.get("RANK", "0") == "0"
    # The config validated and resolved once in this process (`cfg` comes unvalidated), the run takes the result;
    # refused before the run directory is looked at: no "--overwrite: ..." line above a refusal.
    resolved = resolve_run(cfg)
    if main:
        for note in inert_keys(cfg, resolve_device(cfg.run.device)):
            print(f"warning: {note}")
    # Under torchrun rank 0 alone checks the run directory (the others write nothing there; torchrun stops them
    # if rank 0 refuses). The plan commits (clears an --overwrite's old files, writes config.toml) once
    # everything has loaded.
    plan = _run_dir_plan(cfg, args) if main else None
    summary = train(resolved, resume=getattr(args, "resume", False), run_dir=plan)
    if summary.get("reward_failure"):  # every reward call failed, or every call of the correctness function
        return 3
    if not summary.get("stopped_early"):
        return 0
    return 143 if summary.get("stopped_by") == "SIGTERM" else 130


def _train_before_launch(args: argparse.Namespace, nproc: int):
    """What `train --nproc N` checks before torchrun starts the ranks: the config (TOML + --set, validated), what
    it cannot do under torchrun at this world size, and the run directory (checked, nothing written). Returns the
    ranks' roles (exactrl.distributed.roles)."""
    from exactrl.config import load_config
    from exactrl.train.preflight import check_run_config
    from exactrl.train.rundir import check_run_dir

    cfg = load_config(args.config, args.set or [], validate=False)  # check_run_config validates it
    check_run_config(cfg, _trainers(cfg, nproc, distributed=True), distributed=True)
    check_run_dir(
        cfg,
        resume=args.resume,
        overwrite=args.overwrite,
        allow_config_change=args.allow_config_change,
    )
    return _roles(cfg)


def _roles(cfg):
    """A run config's ranks' roles: generator ranks, the engine split, the device."""
    from exactrl.config import resolve_device
    from exactrl.distributed.roles import Roles

    e = cfg.engine
    return Roles(resolve_device(cfg), cfg.distributed.generator_ranks, e.tensor_parallel, e.expert_parallel)


def _trainers(cfg, world_size: int, *, distributed: bool) -> int:
    """The ranks of `world_size` that train (distributed.generator_ranks left out): what the run's preflight and
    memory plan count, as its trainers do under torchrun (refused by key where the layout cannot work)."""
    from exactrl.distributed.layout import trainer_ranks
    from exactrl.train.memory import engine_group_ranks

    g = cfg.distributed.generator_ranks
    return trainer_ranks(world_size, g, engine_group_ranks(cfg), distributed=distributed)


def config_device(path: str | Path | None, overrides: list[str]) -> str:
    """run.device of a config, read without building it: the TOML's, then the last `--set run.device=...`; "auto"
    where neither says. The CLI caps the host's threads by it before the command starts
    (exactrl.cli.cap_host_threads); the command reads and validates the whole config itself, and says what is
    wrong with a file this cannot read."""
    from exactrl.config import parse_override, tomllib  # the backport on Python 3.10

    device: object = "auto"
    if path is not None:
        try:
            run = tomllib.loads(Path(path).read_text(encoding="utf-8")).get("run", {})
            device = run.get("device", device) if isinstance(run, dict) else device
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
            pass
    for item in overrides:
        key, _, _ = item.partition("=")
        if key.strip() == "run.device":
            try:
                device = parse_override(item)[1]
            except ValueError:
                pass
    return device if isinstance(device, str) else "auto"


def _config_device(args: argparse.Namespace) -> str:
    return config_device(args.config, args.set or [])


def _eval_device(args: argparse.Namespace) -> str:
    """eval's device as cmd_eval chooses it: --device, else the config's (--config, or the run's found from
    --model), else auto."""
    if args.device:
        return args.device
    config = args.config
    if config is None and not args.no_run_config:
        config = find_run_config(args.model)
    return config_device(config, args.set or []) if config is not None else "auto"


def _bench_device(args: argparse.Namespace) -> str:
    """bench's --device, or the last `--set run.device=...` of bench rl's run config."""
    runs = [o for o in getattr(args, "overrides", None) or [] if o.partition("=")[0].strip() == "run.device"]
    return config_device(None, runs) if runs else args.device


def cmd_train(args) -> int:
    from exactrl.config import load_config

    return _run(load_config(args.config, args.set or [], validate=False), args)  # _run validates it


def cmd_sft(args) -> int:
    """SFT only: the warm start of the config, then save the checkpoint and evaluate. --resume continues an
    interrupted SFT from its last checkpoint (sft-checkpoints/)."""
    from exactrl.config import load_config

    cfg = load_config(args.config, (args.set or []) + ["train.steps=0"], validate=False)  # _run validates it
    if cfg.sft.steps <= 0:
        raise ValueError("sft.steps is 0 in this config: nothing to train (set --set sft.steps=N)")
    return _run(cfg, args)


def find_run_config(model_dir: str | Path) -> Path | None:
    """The config.toml of the run a checkpoint directory belongs to (runs/X/checkpoints/step-N/policy or
    runs/X/sft -> runs/X/config.toml), or None. Only a directory that holds a run's outputs counts."""
    d = Path(model_dir).resolve()
    for parent in [d, *d.parents][:4]:
        c = parent / "config.toml"
        if c.is_file() and any(
            (parent / n).exists() for n in ("metrics.jsonl", "checkpoints", "summary.json", "sft")
        ):
            return c
    return None


def cmd_eval(args) -> int:
    import sys

    from exactrl.config import load_config
    from exactrl.engine.engine import RolloutEngine
    from exactrl.model.loading import load_policy
    from exactrl.tasks import RewardComputer
    from exactrl.train.loop import build_task, env_setup, evaluate, make_encoder

    config = args.config
    if config is None and not args.no_run_config:
        run_config = find_run_config(args.model)
        if run_config is not None:
            config = str(run_config)
            print(
                f"eval: task, reward and sampling settings from the run's {run_config} "
                "(--config FILE or --no-run-config to change that)",
                file=sys.stderr,
            )
    elif config is not None:
        print(f"eval: task, reward and sampling settings from {config}", file=sys.stderr)
    # model.preset=none: --model replaces the config's model, which may be a preset (exactly one may be set)
    overrides = list(args.set or []) + ["model.preset=none", f"model.path={args.model}"]
    if args.task:  # else the config's task (arithmetic without a config)
        overrides.append(f"task.name={args.task}")
    if args.data:
        overrides += [f"task.path={args.data}", "task.eval_path=none"]
    cfg = load_config(config, overrides)
    # Unset flags take the config's values: then a run's checkpoint is scored as the run scored it.
    samples = args.samples or (cfg.task.eval_samples if config else 1)
    temperature = args.temperature
    if temperature is None:
        temperature = cfg.task.eval_temperature if config else 0.0
    if samples > 1 and temperature == 0:
        temperature = 1.0  # pass@k with greedy decoding would draw k identical samples
    max_tokens = args.max_tokens or (cfg.sampling.max_tokens if config else 64)
    exact = cfg.run.exact if args.mode is None else args.mode == "exact"
    device = args.device or (cfg.run.device if config else "auto")
    model, tok = load_policy(
        path=args.model,
        device=device,
        dtype=cfg.model.dtype,
        exact=exact,
        fp32_lm_head=cfg.model.fp32_lm_head,
    )
    from exactrl.model.lora import attach_checkpoint_adapter

    attach_checkpoint_adapter(model, args.model, args.base_only, "eval")
    num = args.num or cfg.task.num_eval
    # Every record of --data is an eval example (a JsonlTask would hold most of them out for training).
    if args.data:
        from exactrl.tasks.jsonl import load_dataset

        fmt = "parquet" if cfg.task.name == "parquet" else "jsonl"
        examples = load_dataset(args.data, cfg.task.prompt_field, cfg.task.answer_field, fmt)[0][:num]
    else:
        examples = build_task(cfg).eval_examples(num)
    encode = make_encoder(cfg, tok)
    # As train leaves them out of its held-out evaluation: prompts too long for the run's limits.
    limit = min(cfg.task.max_prompt_tokens, cfg.engine.max_model_len - max_tokens)
    kept = [ex for ex in examples if len(encode(ex)) <= limit]
    if len(kept) < len(examples):
        print(
            f"eval: {len(examples) - len(kept)} prompts longer than {limit} tokens (task.max_prompt_tokens, "
            "engine.max_model_len - max tokens) left out",
            file=sys.stderr,
        )
    # Relative reward files and modules: from the working directory, as every path (exactrl.config).
    rewards = RewardComputer.from_config(cfg.reward, device=device)
    engine = RolloutEngine(model, cfg.engine, tokenizer=tok)
    # A tool agent is scored with its tool, as train scores it: episodes through the run's environment.
    env = None
    if cfg.env.name:
        env = env_setup(cfg)
    res = evaluate(
        engine,
        tok,
        encode,
        kept,
        rewards,
        samples=samples,
        temperature=temperature,
        max_tokens=max_tokens,
        seed=cfg.run.seed,
        stop=cfg.sampling.stop,  # as train's held-out evaluation does
        stop_token_ids=cfg.sampling.stop_token_ids,
        env=env,
    )
    print(json.dumps(res) if args.json else "\n".join(f"{k}: {v:.4f}" for k, v in res.items()))
    return 0


def cmd_report(args) -> int:
    from exactrl.model.files import writing
    from exactrl.report import draw_report, episode_summary, read_metrics

    for line in episode_summary(read_metrics(args.run_dir)):  # a multi-turn run's episodes, in numbers
        print(line)
    with writing(args.out or Path(args.run_dir) / "report.png", "the report"):
        print(draw_report(args.run_dir, args.out))
    return 0


def cmd_parity_replay(args) -> int:
    """`exactrl parity --replay DIR`: exit 1 when any difference remains (tokens, a recomputed divergence, a
    recorded value that does not reproduce)."""
    import sys

    from exactrl.guard.replay import replay_report

    res = replay_report(
        args.replay, device=None if args.device == "auto" else args.device, exact=args.mode == "exact"
    )
    print(json.dumps(res.to_dict()) if args.json else res.text())
    if res.ok:
        print("replay: OK (tokens re-sampled, logprobs bitwise equal and reproduced)", file=sys.stderr)
        return 0
    bad = sum(not s.ok for s in res.sequences)
    print(f"replay: FAIL ({bad} of {len(res.sequences)} sequences still differ)", file=sys.stderr)
    return 1


def cmd_twin(args) -> int:
    from exactrl.guard.twin import run_twin

    run_twin(
        args.config,
        args.set or [],
        steps=args.steps if args.steps > 0 else None,
        out_dir=args.out,
        tis=args.tis,
        mis=args.mis,
        overwrite=args.overwrite,
    )
    return 0


def cmd_plan(args) -> int:
    """The run's memory plan per rank (exactrl.plan), a disaggregated run's trainer ranks' and generator ranks'
    each; exit 1 when a phase would not fit --gpu-memory, or the optimizer state offload pins would not fit
    --host-memory. The config passes the checks `exactrl train` makes before anything loads
    (exactrl.train.preflight), at the planned world size."""
    from exactrl.config import load_config
    from exactrl.train.memory import gpu_memory_bytes, host_memory_bytes
    from exactrl.train.memory_fit import make_plan, print_plan
    from exactrl.train.memory_generator import make_generator_plan, trainer_role
    from exactrl.train.preflight import check_run_config, inert_keys

    cfg = load_config(args.config, args.set or [])
    world_size = 1 if args.world_size is None else args.world_size
    if world_size < 1:
        raise ValueError(f"exactrl plan: --nproc must be at least 1, got {world_size}")
    # --nproc unset: one device without torchrun; an explicit --nproc N (1 included) is N FSDP2 ranks, as
    # `exactrl train --nproc N` runs them.
    sharded = args.world_size is not None
    if not sharded:
        _plan_needs_nproc(cfg)
    # A disaggregated run: the trainers' plan (FSDP2 over them alone), then the generator ranks' (the engine alone).
    job_size = world_size
    trainers = _trainers(cfg, world_size, distributed=sharded)
    if trainers != world_size:
        g = cfg.distributed.generator_ranks
        print(
            f"planned for the {_ranks(trainers, 'trainer')} of {world_size} and, below "
            f"{'it' if trainers == 1 else 'them'}, the {_ranks(g, 'generator')} (distributed.generator_ranks = "
            f"{g}) that hold{'s' if g == 1 else ''} the engine alone"
        )
        print(f"{trainer_role(world_size, trainers)}:")
    world_size = trainers
    check_run_config(cfg, world_size, distributed=sharded)
    gpu = gpu_memory_bytes(args.gpu_memory)
    host = gpu_memory_bytes(args.host_memory, "--host-memory")
    # run.device = "cpu" plans a CPU run (host memory per rank, no verdict) unless --gpu-memory asks for a GPU;
    # "auto" and "cuda" plan a CUDA device.
    device = "cpu" if cfg.run.device == "cpu" and gpu is None else "cuda"
    if cfg.run.device == "cpu" and gpu is not None:
        print(
            f'run.device = "cpu" in the config: planned for a CUDA device of {args.gpu_memory:g} GiB (--gpu-memory)'
        )
    for note in inert_keys(cfg, device):
        print(f"note: {note}")
    here = False  # whether the device planned is this machine's GPU
    if gpu is None and device == "cuda":
        import torch

        if torch.cuda.is_available():
            gpu, here = torch.cuda.get_device_properties(0).total_memory, True
    # The host is this machine's only when the GPU is too: planning a GPU node from a laptop or a login node
    # (--gpu-memory, or no GPU here) checks pinned host memory only against a given --host-memory.
    host_from = "--host-memory" if host is not None else "not checked"
    if host is None and here:
        host, host_from = host_memory_bytes(), "this machine"
    plan = make_plan(
        cfg, world_size=world_size, gpu_memory=gpu, device=device, host_memory=host, sharded=sharded,
        host_memory_from=host_from,
    )  # fmt: skip
    generator = None
    if trainers != job_size:
        plan.role = trainer_role(job_size, trainers)
        generator = make_generator_plan(cfg, world_size=job_size, gpu_memory=gpu, device=device)
    print_plan(plan, generator=generator, json_line=args.json)
    return 0 if plan.fits and (generator is None or generator.fits) else 1


def _ranks(n: int, role: str) -> str:
    return f"{n} {role} rank{'' if n == 1 else 's'}"


def _plan_needs_nproc(cfg) -> None:
    """Refuse a plan without --nproc of a config that only runs on torchrun ranks (generator ranks, an engine split
    over ranks), saying to pass --nproc to plan."""
    e, g = cfg.engine, cfg.distributed.generator_ranks
    keys = [f"distributed.generator_ranks = {g}"] if g else []
    keys += [f"engine.{k} = {v}" for k, v in (("tensor_parallel", e.tensor_parallel), ("expert_parallel", e.expert_parallel)) if v > 1]  # fmt: skip
    if keys:
        raise ValueError(
            f"{' and '.join(keys)} run{'' if len(keys) > 1 else 's'} on torchrun ranks: pass --nproc N to `exactrl plan` (the run's ranks, as "
            "`exactrl train --nproc N` would start them) to plan each rank"
        )


def _bench_before_launch(args: argparse.Namespace, nproc: int):
    """What `bench --nproc N` checks before torchrun starts the ranks: its options (`bench.check_ranks`), and for
    bench rl the run config it builds, as `exactrl train --nproc N` checks its own (the layout of generator ranks,
    the modes, the engine split on the model's shape). Returns the ranks' roles."""
    import tempfile

    from exactrl import bench

    bench.apply_defaults(args)
    bench.check_ranks(args, nproc)
    bench.baseline_of(args)  # a --baseline of another benchmark or shape
    if args.what == "rl" and not args.plot_from:
        from exactrl.bench_rl import _config, check_options
        from exactrl.train.preflight import check_run_config

        check_options(args)
        cfg = _config(args, tempfile.gettempdir(), args.warmup + args.steps)
        check_run_config(cfg, _trainers(cfg, nproc, distributed=True), distributed=True)
        return _roles(cfg)
    from exactrl.config import resolve_device
    from exactrl.distributed.roles import Roles

    # rollout: an engine on each rank; train --fsdp: the FSDP2 step on each rank
    return Roles(resolve_device(args.device), trains=args.what == "train", generates=args.what == "rollout")


def cmd_bench(args) -> int:
    from exactrl import bench

    return bench.main(args)


def add_nproc_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="run on N local ranks: re-launches this command under `python -m torch.distributed.run "
        "--standalone --nproc-per-node N` (CPU: gloo; CUDA: NCCL, one GPU per rank)",
    )


def add_fsdp_fp8_copies_arg(p: argparse.ArgumentParser, who: str) -> None:
    from typing import get_args

    from exactrl.config.train import FsdpFp8Copies, TrainConfig

    p.add_argument(
        "--fsdp-fp8-copies",
        default=TrainConfig.fsdp_fp8_copies,
        choices=get_args(FsdpFp8Copies),
        help=f"with --precision fp8 under --nproc: {who}'s fp8 copies, kept between steps or quantized for each "
        "use (train.fsdp_fp8_copies; docs/fp8.md)",
    )


def register(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.ArgumentDefaultsHelpFormatter  # --help shows every default
    p = sub.add_parser("train", help="run an RL job from a TOML config", formatter_class=fmt)
    p.add_argument("config", help="the run's TOML config")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint of the run")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run.output_dir that holds a run: delete its metrics, checkpoints, events, summary",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="--resume with a config that differs from the run's config.toml in keys that change the run",
    )
    add_nproc_arg(p)
    add_nodes_args(p)
    p.set_defaults(func=cmd_train, before_launch=_train_before_launch, device_of=_config_device)

    p = sub.add_parser(
        "plan",
        help="predicted peak device memory per rank of each phase (generation, training, optimizer)",
        formatter_class=fmt,
    )
    p.add_argument("config", help="the run's TOML config")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    # Its own dest: `args.nproc` makes the CLI re-launch the command under torchrun; a plan only counts ranks.
    p.add_argument(
        "--nproc",
        dest="world_size",
        type=int,
        default=None,
        metavar="N",
        help="torchrun ranks (FSDP2 world size) the run would use, as `exactrl train --nproc N`: --nproc 1 is one "
        "FSDP2 rank (sharded layout, the larger FSDP2 microbatch); unset: one device without torchrun",
    )
    p.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GB",
        help="device memory per rank in GiB to check the plan against (default: this machine's GPU; none on a "
        "CPU: the plan is printed without a verdict)",
    )
    p.add_argument(
        "--host-memory",
        type=float,
        default=None,
        metavar="GB",
        help='host RAM in GiB that train.offload = "optimizer" pins its state in (default: this machine\'s when the '
        "plan is for this machine's GPU; not checked when --gpu-memory plans another machine)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='also print the plan as one JSON line after the tables ({"memory_plan": ..., "generator_memory_plan": ...})',
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "sft", help="supervised warm start only (the config's [sft] section)", formatter_class=fmt
    )
    p.add_argument("config", help="the run's TOML config")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument("--overwrite", action="store_true", help="start over in a non-empty run.output_dir")
    p.add_argument(
        "--resume", action="store_true", help="continue an interrupted SFT from its last checkpoint"
    )
    p.set_defaults(func=cmd_sft, device_of=_config_device)

    p = sub.add_parser(
        "eval", help="accuracy and pass@k of a checkpoint on held-out prompts", formatter_class=fmt
    )
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument(
        "--base-only",
        action="store_true",
        help="a LoRA run's checkpoint policy/: the base without the adapters beside it (loaded by default)",
    )
    p.add_argument(
        "--task",
        choices=["arithmetic", "jsonl"],
        help="default: the task of the config (the run's or --config), else arithmetic",
    )
    p.add_argument("--data", help="JSONL file for --task jsonl")
    p.add_argument(
        "--config",
        help="take task/reward/sampling settings from this TOML config (default: the config.toml of the run "
        "the checkpoint is in, found by walking up from --model)",
    )
    p.add_argument("--no-run-config", action="store_true", help="do not look for the run's config.toml")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="samples per prompt (pass@k with k = samples; accuracy is the mean over them); default: "
        "task.eval_samples of the config, else 1",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: task.eval_temperature of the config, else 0 (greedy); 1.0 when samples > 1 and 0",
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="default: sampling.max_tokens of the config, else 64"
    )
    p.add_argument("--num", type=int, default=0, help="number of held-out examples (0 = task.num_eval)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda or auto; default: run.device of the config, else auto"
    )
    p.add_argument(
        "--mode", default=None, choices=["exact", "fast"], help="default: run.exact of the config, else exact"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval, device_of=_eval_device)

    p = sub.add_parser(
        "twin",
        help="the same config and seed in exact, fast and fast + TIS mode, with one comparison report",
        formatter_class=fmt,
    )
    p.add_argument("config", help="the run's TOML config")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    p.add_argument(
        "--steps",
        type=int,
        default=60,
        help="RL steps of every run (overrides train.steps; 0 = the config's)",
    )
    p.add_argument("--out", help="twin folder, one subfolder per run (default: <run.output_dir>-twin)")
    p.add_argument(
        "--tis", default="token-tis", choices=["token-tis", "seq-tis"], help="the correction of the TIS run"
    )
    p.add_argument(
        "--mis",
        choices=["token-mis", "seq-mis", "icepop"],
        help="also run fast mode with this masking correction",
    )
    p.add_argument("--overwrite", action="store_true", help="start over in run folders that hold a run")
    p.set_defaults(func=cmd_twin, device_of=_config_device)

    p = sub.add_parser(
        "report",
        help="draw a run's curves to a PNG (a multi-turn run's episodes also summed up in text)",
        formatter_class=fmt,
    )
    p.add_argument("run_dir", help="the run's output_dir (with metrics.jsonl)")
    p.add_argument("--out", help="output PNG (default RUN_DIR/report.png)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "bench",
        help="benchmarks: rollout (engine tok/s), train (tok/s, MFU) or rl (whole GRPO steps and their stages)",
        formatter_class=fmt,
    )
    p.add_argument("what", choices=["rollout", "train", "rl"], help="which benchmark")
    p.add_argument("--preset", default="qwen3-0.6b", help="random-init model shape")
    p.add_argument("--model", help="HF checkpoint directory instead of a preset")
    p.add_argument("--mode", default="exact", choices=["exact", "fast"], help="kernels")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="model dtype")
    p.add_argument(
        "--precision",
        default="dtype",
        choices=["dtype", "fp8"],
        help="dtype: projections in the model dtype; fp8: e4m3 weights (128 x 128 block scales) and activations (per token and 128 channels), LM head and attention in dtype (docs/fp8.md)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=256,
        help="rollout: concurrent sequences (with --nproc N: in all, split over the ranks)",
    )
    p.add_argument("--prompt-len", type=int, default=128, help="rollout: prompt tokens")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="rollout: new tokens per sequence (default 256); rl: the cap of the completion lengths (default 2048)",
    )
    p.add_argument(
        "--tokens-per-microbatch", type=int, default=8192, help="train, rl: tokens per training microbatch"
    )
    p.add_argument("--steps", type=int, default=None, help="train: timed steps (default 5); rl: (default 3)")
    p.add_argument(
        "--busy-cores",
        type=int,
        default=0,
        help="start N processes that each keep a host core busy beside the run (a shared host); the record says "
        "busy_cores",
    )
    p.add_argument(
        "--graphs",
        default="on",
        choices=["on", "off"],
        help="train: replay the step from CUDA graphs; rl: the engine's and the trainer's CUDA graphs",
    )
    p.add_argument(
        "--split-kv",
        default="auto",
        choices=["auto", "off"],
        help="rollout, rl (CUDA): decode steps of few sequences split the keys over programs (auto), or never "
        "(off: the before/after comparison of the split; the bits are the same)",
    )
    rl = p.add_argument_group("rl (a whole GRPO step: generate, reward, train, weight sync)")
    rl.add_argument("--prompts", type=int, default=64, help="prompts per step")
    rl.add_argument("--samples", type=int, default=8, help="samples per prompt (the GRPO group)")
    rl.add_argument("--prompt-min", type=int, default=64, help="shortest prompt, in tokens")
    rl.add_argument("--prompt-max", type=int, default=512, help="longest prompt, in tokens")
    rl.add_argument(
        "--completion-median",
        type=float,
        default=384.0,
        help="median completion length (log-normal, capped at --max-tokens)",
    )
    rl.add_argument("--completion-sigma", type=float, default=0.8, help="log-normal shape of the lengths")
    rl.add_argument("--warmup", type=int, default=1, help="untimed steps first (compiles, graph captures)")
    rl.add_argument("--max-num-seqs", type=int, default=512, help="engine.max_num_seqs")
    rl.add_argument("--kv-memory-fraction", type=float, default=0.45, help="engine.kv_memory_fraction")
    rl.add_argument(
        "--reward", action="append", help="reward function (repeatable; default: the built-in numeric_match)"
    )
    rl.add_argument(
        "--on-mismatch", default="abort", choices=["abort", "skip_step", "warn"], help="run.on_mismatch"
    )
    rl.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a key of the run config the benchmark builds, after its own flags (e.g. "
        "train.offload=optimizer, train.activation_checkpointing=true, engine.expert_parallel=2); repeatable",
    )
    rl.add_argument(
        "--generator-ranks",
        type=int,
        default=0,
        help="with --nproc N: distributed.generator_ranks, the ranks that only generate (the others only train); "
        "0 = every rank colocated",
    )
    rl.add_argument(
        "--max-off-policy-steps",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="algorithm.max_off_policy_steps: 1 = the next batch is sampled during the update (one-step-off); 2 = "
        "with --partial-rollouts",
    )
    rl.add_argument(
        "--partial-rollouts",
        action="store_true",
        help="algorithm.partial_rollouts: each generation stops once the step's groups have finished, the rest "
        "continue in the next (needs --max-off-policy-steps 2)",
    )
    rl.add_argument(
        "--partial-oversample",
        type=float,
        default=0.25,
        help="algorithm.partial_oversample: groups in flight beyond the step's, as a fraction of them",
    )
    rl.add_argument(
        "--overlap",
        default="none",
        choices=["none", "tail"],
        help="algorithm.overlap: tail = finished groups are trained on while the batch's tail generates (on-policy)",
    )
    rl.add_argument("--seed", type=int, default=0, help="seed of the workload, the model and the sampling")
    rl.add_argument(
        "--profile",
        action="store_true",
        help="rl: the last timed step's generate stage under torch.profiler (GPU time by kernel on CUDA, own CPU "
        "time by operator on the CPU) in the table and the JSON; the median step is of the other steps. train "
        "--fsdp: one more step under torch.profiler, operators by device and by host time (printed)",
    )
    rl.add_argument(
        "--plot-from",
        nargs="+",
        metavar="JSON",
        help="draw earlier `bench rl` results (e.g. exact and fast) on one concurrency plot; runs nothing",
    )
    rl.add_argument(
        "--plot", metavar="PNG", help="where the concurrency plot goes (default: next to the JSON)"
    )
    p.add_argument(
        "--vs",
        choices=["hf", "torch"],
        help="also run, on the same weights and data: hf = transformers (eager); torch (train, dense models) = a "
        "compiled stock-PyTorch step of the same shape (SDPA flash attention, fused AdamW)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="train: the step under FSDP2 on torchrun ranks (--nproc N, default 1); at world size 1 also on "
        "today's path, with both step times and their ratio",
    )
    p.add_argument(
        "--baseline",
        metavar="JSON",
        help="the result JSON of the same benchmark at another world size: adds the scaling efficiency (rl: "
        "another layout or world size; adds speedup_vs_baseline, the ratio of the median step times)",
    )
    add_fsdp_fp8_copies_arg(p, "train --fsdp: the FSDP2 step")
    add_nproc_arg(p)
    p.set_defaults(before_launch=_bench_before_launch)
    p.add_argument(
        "--out-dir",
        "--output-dir",
        dest="out_dir",
        default="benchmarks/results",
        help="directory the result JSON is written to",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=cmd_bench, device_of=_bench_device)
