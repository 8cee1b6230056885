"""The `exactrl` command line: one subcommand per job (`exactrl --help` lists them all, from the parser)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from torch.distributed.elastic.multiprocessing.errors import record


def _model_args(p: argparse.ArgumentParser, dtype_default: str = "float32") -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--preset", help=f"random-init model of a named shape ({_preset_names()}); default tiny")
    g.add_argument("--model", help="local HF checkpoint directory")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--dtype", default=dtype_default, choices=["float32", "bfloat16"], help="model dtype")
    p.add_argument(
        "--mode",
        default="exact",
        choices=["exact", "fast"],
        help="exact: batch-invariant kernels; fast: PyTorch defaults",
    )
    p.add_argument("--fp32-lm-head", action="store_true", help="LM head and softmax in fp32")
    p.add_argument(
        "--precision",
        default="dtype",
        choices=["dtype", "fp8"],
        help="dtype: projections in the model dtype; fp8: e4m3 weights (128 x 128 block scales) and activations (per token and 128 channels), LM head and attention in dtype (docs/fp8.md)",
    )
    p.add_argument("--seed", type=int, default=0, help="random init and sampling seed")


def _preset_names() -> str:
    from exactrl.model.config import PRESETS

    return ", ".join(PRESETS)


def _load(args):
    from exactrl.model.loading import load_policy

    preset = args.preset if (args.preset or args.model) else "tiny"
    return load_policy(
        preset_name=preset if not args.model else None,
        path=args.model,
        device=args.device,
        dtype=args.dtype,
        exact=args.mode == "exact",
        fp32_lm_head=args.fp32_lm_head,
        seed=args.seed,
        precision=getattr(args, "precision", "dtype"),
    )


def cmd_init_model(args) -> int:
    from exactrl.model.config import PRESETS
    from exactrl.model.hf import save_model
    from exactrl.model.loading import load_policy

    if args.list:
        for name, c in PRESETS.items():
            print(
                f"{name:17} {c.architecture:9} {c.num_layers:>3} layers  hidden {c.hidden_size:>5}  "
                f"heads {c.num_heads:>3}/{c.num_kv_heads:<3} vocab {c.vocab_size}"
            )
        return 0
    if not args.preset or not args.out:
        raise ValueError(
            f"init-model needs --preset NAME and --out DIR (presets: {_preset_names()}; --list shows them)"
        )
    if args.preset not in PRESETS:
        raise ValueError(
            f"unknown preset {args.preset!r}; presets: {_preset_names()} (--list shows their shapes)"
        )

    overrides = {"num_layers": args.num_layers} if args.num_layers else None
    model, tok = load_policy(
        preset_name=args.preset, device="cpu", dtype=args.dtype, seed=args.seed, preset_overrides=overrides
    )
    save_model(model, args.out, tokenizer=tok)
    print(
        f"wrote {args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {args.dtype}) to {args.out}"
    )
    return 0


def cmd_parity(args) -> int:
    from exactrl.distributed.env import init_from_env, rank_device
    from exactrl.model.loading import resolve_device
    from exactrl.ops import set_exact_environment
    from exactrl.parity import run_parity, sharded_parity_models

    if args.replay:  # recompute a mismatch report instead of sampling random prompts
        from exactrl.commands import cmd_parity_replay

        return cmd_parity_replay(args)
    from exactrl.distributed.env import under_torchrun

    # What the options and the model's shape refuse, before anything loads (as the --nproc launcher checks them).
    _parity_before_launch(args, int(os.environ["WORLD_SIZE"]) if under_torchrun() else None)
    set_exact_environment(args.mode == "exact")
    # Under torchrun: this rank's GPU (or the CPU with gloo); its share of the prompts, an FSDP-sharded trainer.
    ctx = init_from_env(resolve_device(args.device))
    args.device = rank_device(ctx, resolve_device(args.device))
    model, tok = _load(args)
    tp = None
    tp_size, ep_size = args.tensor_parallel, args.expert_parallel
    if (
        tp_size != 1 or ep_size != 1
    ):  # refused by key before any group is made: world size, heads, experts, LoRA
        from exactrl.distributed.expert_parallel import check_expert_parallel
        from exactrl.distributed.shared_engine import engine_group
        from exactrl.distributed.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(model, tp_size)
        check_expert_parallel(model, ep_size)
        tp = engine_group(ctx.rank, ctx.world_size, tp_size, ep_size)
    engine_model, scorer = (
        sharded_parity_models(
            model,
            ctx,
            tp,
            tensor_parallel=tp_size,
            expert_parallel=ep_size,
            fp8_copies=args.fsdp_fp8_copies,
        )
        if ctx.distributed
        else (model, model)
    )
    temps = args.temperature or [0.7]
    results = []
    for t in temps:
        r = run_parity(
            engine_model,
            scorer=scorer,
            dist=ctx,
            num_prompts=args.num_prompts,
            max_tokens=args.max_tokens,
            temperature=t,
            seed=args.seed,
            samples_per_prompt=args.samples_per_prompt,
            kv_blocks=args.kv_blocks if args.kv_blocks != -1 else None,
            prefill_chunk=args.prefill_chunk,
            shared_prefix=args.shared_prefix,
            prompt_vocab=tok.vocab_size,
            tp=tp,
            tensor_parallel=tp_size,
            expert_parallel=ep_size,
        )
        results.append(r)
    if args.json:
        import torch

        # What ran, for a record read apart from its command: the model (a preset or a checkpoint) and the GPU.
        model = {"model": args.model} if args.model else {"preset": args.preset or "tiny"}
        dev = torch.device(args.device)
        gpu = {"gpu": torch.cuda.get_device_name(dev)} if dev.type == "cuda" else {}
        for r in results:
            print(json.dumps({**r.to_dict(), **model, **gpu}))
    else:
        print(
            f"{'mode':6} {'device':6} {'dtype':9} {'temp':>5} {'tokens':>8} {'mismatched':>10} {'max|diff|':>10} "
            f"{'same tokens':>11} {'preempt':>7} {'sec':>6}"
        )
        for r in results:
            print(
                f"{r.mode:6} {r.device:6} {r.dtype:9} {r.temperature:5.2f} {r.num_tokens:8d} {r.num_mismatched:10d} "
                f"{r.max_abs_diff:10.3g} {str(r.tokens_identical_across_compositions):>11} {r.preemptions:7d} {r.seconds:6.1f}"
            )
    for r in results:
        _print_rank0(r.exercised(), file=sys.stderr)
    failed = False
    for r in results:
        if r.num_mismatched:
            _print_rank0(
                f"FAIL (T = {r.temperature:g}, {r.mode} mode): {r.num_mismatched} of {r.num_tokens} rollout "
                "logprobs differ from the trainer's",
                file=sys.stderr,
            )
        if not r.tokens_identical_across_compositions:
            _print_rank0(
                f"FAIL (T = {r.temperature:g}, {r.mode} mode): {r.sequences_with_other_tokens} of "
                f"{r.num_sequences} sequences sampled other tokens in another batch composition (sampling is "
                "not batch-invariant: runs do not replay)",
                file=sys.stderr,
            )
        failed = failed or not r.ok
    if not failed:
        _print_rank0(
            "parity: OK (logprobs bitwise equal, tokens identical in every composition)", file=sys.stderr
        )
    return 1 if failed else 0


def _print_rank0(*args, **kwargs) -> None:
    """print, on rank 0 only (stderr included: the results are the same on every rank)."""
    if os.environ.get("RANK", "0") == "0":
        print(*args, **kwargs)


def cmd_generate(args) -> int:
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.model.lora import attach_checkpoint_adapter

    prompts = _generate_prompts(args)  # before the model loads: a missing prompt is said at once
    model, tok = _load(args)
    attach_checkpoint_adapter(model, args.model, args.base_only, "generate")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        n=args.n,
        stop=args.stop or [],
        stop_token_ids=tok.stop_token_ids,
    )
    engine = RolloutEngine(
        model,
        EngineConfig(
            block_size=args.block_size, num_kv_blocks=args.kv_blocks, max_model_len=args.max_model_len
        ),
        tokenizer=tok,
    )
    if args.env:
        return _generate_episodes(args, engine, tok, prompts, params)
    if args.answer or args.env_option:
        raise ValueError("--answer and --env-option are for episodes: add --env NAME")
    ids = [tok.encode(p) for p in prompts]
    outs = engine.generate(ids, params)
    failed = 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if out.error is not None:  # refused (too long, empty): said by index, the other prompts still run
            failed += 1
            _prompt_refused(i, prompt, out.error + _length_hint(len(ids[i]), engine), len(prompts))
            continue
        for s in out.samples:
            rec = {
                "prompt": prompt,
                "completion": tok.decode(s.token_ids),
                "token_ids": s.token_ids,
                "rollout_logprobs": [float(x) for x in s.rollout_logprobs],
                "finish_reason": s.finish_reason,
            }
            if args.json:
                print(json.dumps(rec))
            else:
                print(f"[{s.finish_reason}] {prompt!r} -> {rec['completion']!r}")
    return _refusal_status(failed, len(prompts))


def _generate_prompts(args) -> list[str]:
    """The prompts of `generate`: every --prompt, then each non-blank line of --prompts-file; none is a usage
    error (the command would otherwise print nothing and succeed)."""
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        where = f" (--prompts-file {args.prompts_file} has no non-blank line)" if args.prompts_file else ""
        raise ValueError(
            f"no prompt to generate from{where}: give --prompt TEXT (repeatable) or --prompts-file FILE"
        )
    return prompts


def _prompt_refused(i: int, prompt: str, error: str, total: int) -> None:
    """One line on stderr for a prompt the engine refused: which one (1-based, as printed), how it starts, why."""
    head = prompt if len(prompt) <= 40 else prompt[:40] + "..."
    print(f"exactrl generate: error: prompt {i + 1} of {total} {head!r}: {error}", file=sys.stderr)


def _length_hint(num_tokens: int, engine, episode_tokens: int | None = None) -> str:
    """Which flag lets a prompt of num_tokens tokens (plus one new token) in, if any does."""
    positions = engine.model.config.max_position_embeddings
    if (
        episode_tokens is not None
        and episode_tokens < engine.max_model_len
        and num_tokens + 1 > episode_tokens
    ):
        return " (raise --max-episode-tokens)"
    if num_tokens + 1 <= engine.max_model_len:
        return ""  # not a length refusal
    if num_tokens + 1 <= positions:
        return f" (raise --max-model-len; the model has {positions} positions)"
    return " (the model has no more positions: shorten the prompt)"


def _refusal_status(failed: int, total: int) -> int:
    """Exit status of `generate`: 1 when any prompt was refused (the others were generated), else 0."""
    if failed:
        print(f"exactrl generate: {failed} of {total} prompts refused (see above)", file=sys.stderr)
        return 1
    return 0


def _generate_episodes(args, engine, tok, prompts: list[str], params) -> int:
    """`generate --env NAME`: one episode per prompt and sample against the environment, every turn printed
    (the model's text, the environment's observation), then how the episode ended and its reward."""
    from exactrl.envs import EpisodeSettings, env_factory, run_episodes
    from exactrl.envs.rollout import env_stop
    from exactrl.tasks.base import Example

    answers = list(args.answer or [])
    if answers and len(answers) != len(prompts):
        raise ValueError(f"--answer: give one per prompt ({len(prompts)} prompts), got {len(answers)}")
    answers = answers or [""] * len(prompts)  # no reference answer: a correctness reward scores 0
    options = {}
    for item in args.env_option or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env-option: expected KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)  # numbers, true/false, quoted strings
        except json.JSONDecodeError:
            options[key] = value
    cls, make = env_factory(args.env, options)
    params.stop = env_stop(params.stop, cls)
    settings = EpisodeSettings(
        max_turns=args.max_turns,
        max_tokens_per_turn=args.max_tokens,
        max_episode_tokens=min(args.max_episode_tokens, engine.max_model_len),
        timeout_s=args.env_timeout,
    )
    examples = [Example(p, a) for p, a in zip(prompts, answers)]
    ids = [tok.encode(p) for p in prompts]
    batch = run_episodes(engine, tok, examples, ids, make, settings, params)
    failed = 0
    for i, (prompt, group, err) in enumerate(zip(prompts, batch.groups, batch.errors)):
        if err is not None:
            failed += 1
            hint = _length_hint(len(ids[i]), engine, settings.max_episode_tokens)
            _prompt_refused(i, prompt, err + hint, len(prompts))
            continue
        for e in group:
            parts = sorted([(s, t, "model") for s, t in e.turns] + [(s, t, "env") for s, t in e.observations])
            if args.json:
                rec = {
                    "prompt": prompt,
                    "answer": examples[i].answer,
                    "sample": e.sample_index,
                    "turns": [
                        {
                            "role": who,
                            "text": tok.decode(e.completion_ids[s:t]),
                            "token_ids": e.completion_ids[s:t],
                        }
                        for s, t, who in parts
                    ],
                    "rollout_logprobs": [float(x) for x in e.rollout_logprobs],
                    "loss_mask": e.loss_mask,
                    "reward": e.reward,
                    "finish_reason": e.finish_reason,
                    "tool_calls": e.tool_calls,
                    "tool_errors": e.tool_errors,
                    "error": e.error,
                }
                print(json.dumps(rec))
                continue
            print(f"== prompt {i + 1}, sample {e.sample_index + 1}: {prompt!r}")
            turn = 0
            for s, t, who in parts:
                text = tok.decode(e.completion_ids[s:t])
                if who == "model":
                    turn += 1
                    print(f"  [turn {turn}] model: {text!r}")
                else:
                    print(f"  [turn {turn}] env:   {text!r}")
            why = f" ({e.error})" if e.error else ""
            print(
                f"  -> {e.finish_reason}{why}: reward {e.reward:g}, {e.num_turns} turns, {e.tool_calls} tool "
                f"calls, {e.tool_errors} tool errors, {len(e.completion_ids)} tokens "
                f"({e.num_observation_tokens} from the environment)"
            )
    return _refusal_status(failed, len(prompts))


def check_before_launch(args: argparse.Namespace, nproc: int):
    """Refuse, before torchrun starts anything, what the command cannot do on `nproc` ranks: its row of
    commands.NOT_ON_RANKS (N > 1), and its own checks of its options and config (`before_launch`, set by its
    parser: the same validation the command runs on each rank). Raises ValueError. Returns what `before_launch`
    returns: the ranks' roles (exactrl.distributed.roles.Roles), or None."""
    from exactrl.commands import NOT_ON_RANKS

    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    if nproc > 1:
        for command, applies, why in NOT_ON_RANKS:
            if command == args.command and applies(args):
                raise ValueError(why(args) if callable(why) else why)
    before_launch = getattr(args, "before_launch", None)
    return before_launch(args, nproc) if before_launch is not None else None


def _parity_before_launch(args: argparse.Namespace, nproc: int | None):
    """parity's refusals that depend only on its options and the model's shape (its config: a preset, or the
    checkpoint's config.json; nothing loads), before torchrun starts anything (`--nproc N`) and again on every rank
    (`cmd_parity`: N = the world size under torchrun, None in one process). The engine split names the key that is
    wrong; a split without ranks asks for --nproc. Returns the ranks' roles."""
    from exactrl.config import resolve_device
    from exactrl.distributed.roles import Roles
    from exactrl.distributed.shared_engine import check_engine_split, engine_group_size

    g = engine_group_size(args.tensor_parallel, args.expert_parallel)
    flag, key = (
        ("--tensor-parallel", "tensor_parallel")
        if args.tensor_parallel == g
        else ("--expert-parallel", "expert_parallel")
    )
    if nproc is not None and nproc % g:
        raise ValueError(
            f"{flag} (engine.{key} = {g}) must divide --nproc ({nproc}): every engine needs {g} ranks of its own"
        )
    if g > 1:  # the model's shape: heads, widths and experts the split must divide
        check_engine_split(_model_shape(args), args.tensor_parallel, args.expert_parallel)
    if nproc is None:
        if g > 1:
            raise ValueError(
                f"{flag} {g} (engine.{key}) splits one engine over {g} ranks: pass --nproc N, a multiple of {g} "
                f"(e.g. --nproc {g}), to run it on ranks"
            )
    else:
        engines = nproc // g
        if args.num_prompts < engines:  # as run_parity says on each rank
            what = (
                f"ranks ({nproc})" if g == 1 else f"engines ({engines}: {nproc} ranks / {g} ranks an engine)"
            )
            raise ValueError(f"--num-prompts ({args.num_prompts}) must be at least the number of {what}")
    return Roles(
        resolve_device(args.device),
        tensor_parallel=args.tensor_parallel,
        expert_parallel=args.expert_parallel,
    )


def _model_shape(args: argparse.Namespace):
    """The ModelConfig `_load` would build, read without building the model: --model's config.json or the
    preset's (tiny by default)."""
    from exactrl.model.config import preset
    from exactrl.model.hf import read_config

    if args.model:
        return read_config(args.model)
    return preset(args.preset or "tiny")


def cap_host_threads(args: argparse.Namespace) -> int:
    """Cap the host's intra-op threads before a command that computes on CUDA does any work (the rule is
    `limit_host_threads`': CUDA runs only, never over an OMP_NUM_THREADS the user or torchrun set). Every command
    passes here, so train, sft, eval, generate, parity, twin and every bench kind are capped alike. The device is
    the command's `device_of(args)` (set by its parser: a config's run.device) or its --device flag; a command with
    neither (plan, report, init-model) computes on no GPU. Returns the thread count now."""
    import torch

    from exactrl.config import resolve_device
    from exactrl.distributed.env import limit_host_threads

    device_of = getattr(args, "device_of", None)
    device = device_of(args) if device_of is not None else getattr(args, "device", None)
    if device:
        try:
            device = resolve_device(device)
            torch.device(device)
        except (RuntimeError, ValueError):  # not a device: the command itself says so
            return torch.get_num_threads()
        return limit_host_threads(device)
    return torch.get_num_threads()


def _quiet_unless_rank0() -> None:
    """Under torchrun only rank 0 speaks: the other ranks' stdout goes nowhere and their (duplicate) warnings
    are dropped. stderr stays open, so a rank's error and traceback are shown whichever rank it is."""
    import warnings

    rank = os.environ.get("RANK")
    if rank is not None and rank != "0":
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        warnings.simplefilter("ignore")


def main(argv: list[str] | None = None) -> int:
    """The console script. Under a plain torchrun it runs inside torch.distributed.elastic's `record`, which
    writes a failing rank's exception and traceback to the error file torchrun's agent reads and prints in its
    report (outside torchrun there is no such file, and `record` would turn `--help`'s SystemExit into a return).
    Under exactrl's own launcher (`--nproc N`) a rank's error goes to the launcher instead, which prints the first
    one once (`_say_error`)."""
    from exactrl.distributed.env import under_torchrun
    from exactrl.distributed.heartbeat import RANK_ERRORS_ENV

    if under_torchrun() and not os.environ.get(RANK_ERRORS_ENV):
        return int(record(_main)(argv) or 0)
    return _main(argv)


def _say_error(text: str, status: int) -> None:
    """A command's error, ahead of exiting with `status`: to exactrl's launcher when it started this rank (it
    prints the first failing rank's error once), else on stderr."""
    from exactrl.distributed.heartbeat import write_rank_error

    if not write_rank_error(text, status):
        # One write of the whole line: print's text and newline are two writes to an unbuffered stderr, and the
        # ranks of one launch share it, so two ranks' errors could run into one line.
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _main(argv: list[str] | None = None) -> int:
    from exactrl.commands import add_fsdp_fp8_copies_arg, add_nproc_arg

    _quiet_unless_rank0()
    parser = argparse.ArgumentParser(prog="exactrl")
    sub = parser.add_subparsers(dest="command", required=True)
    fmt = argparse.ArgumentDefaultsHelpFormatter  # --help shows every default

    p = sub.add_parser(
        "init-model",
        help="write a random-init HF checkpoint plus tokenizer",
        description=f"Presets: {_preset_names()}.",
        formatter_class=fmt,
    )
    p.add_argument("--preset", help=f"model shape: {_preset_names()}")
    p.add_argument("--out", help="output directory")
    p.add_argument("--list", action="store_true", help="list the presets and their shapes, then exit")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="weights dtype")
    p.add_argument("--seed", type=int, default=0, help="random init seed")
    p.add_argument(
        "--num-layers", type=int, default=None, help="keep the preset's shape but only this many layers"
    )
    p.set_defaults(func=cmd_init_model)

    p = sub.add_parser(
        "parity", help="engine logprobs vs trainer logprobs, token by token", formatter_class=fmt
    )
    _model_args(p)
    p.add_argument(
        "--num-prompts", type=int, default=6, help="prompts (each sampled --samples-per-prompt times)"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per sample")
    p.add_argument(
        "--temperature", type=float, action="append", help="repeat for several temperatures (default: 0.7)"
    )
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=4,
        help="samples per prompt: forks share the prompt's KV blocks",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=0,
        help="KV blocks in the cache; 0: room for about two requests, so that the scheduler preempts; "
        "-1: sized from memory",
    )
    p.add_argument("--prefill-chunk", type=int, default=16, help="longest prefill chunk in tokens")
    p.add_argument(
        "--shared-prefix", type=int, default=16, help="tokens every other prompt shares (prefix-cache hits)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per temperature")
    p.add_argument(
        "--replay",
        metavar="DIR",
        help="recompute a run's mismatch report (<output_dir>/mismatch-<step>/) from its weights and print where "
        "engine and trainer diverge; --device defaults to the run's, --mode to exact",
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="T",
        help="engine.tensor_parallel: each group of T ranks shares one engine split over them (1/T of its weights "
        "and KV cache each), checked against the FSDP2 trainer; T must divide --nproc",
    )
    p.add_argument(
        "--expert-parallel",
        type=int,
        default=1,
        metavar="E",
        help="engine.expert_parallel: each group of E ranks shares one engine whose routed experts are split over "
        "them (1/E of every sparse layer's each), checked against the FSDP2 trainer; E must divide --nproc and "
        "the model's experts, and equal --tensor-parallel when both are above 1",
    )
    add_fsdp_fp8_copies_arg(p, "the FSDP2 trainer")
    add_nproc_arg(p)
    p.set_defaults(func=cmd_parity, before_launch=_parity_before_launch)

    p = sub.add_parser("generate", help="sample completions with the rollout engine", formatter_class=fmt)
    _model_args(p)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("-n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0 = no top-k filter")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per sample")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="longest prompt + completion in tokens (capped at the model's max_position_embeddings); a longer "
        "prompt is refused by index, the others are generated, and the exit status is 1",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per sample (per episode with --env)")
    p.add_argument(
        "--base-only",
        action="store_true",
        help="a LoRA run's checkpoint policy/: the base without the adapters beside it (loaded by default)",
    )
    g = p.add_argument_group("multi-turn episodes (--env)")
    g.add_argument(
        "--env",
        help='run episodes against an environment ("calculator", "guess" or module:Class) and print every turn; '
        "--max-tokens is then per turn",
    )
    g.add_argument(
        "--answer", action="append", help="the reference answer of each --prompt, in order (rewards)"
    )
    g.add_argument("--max-turns", type=int, default=4, help="most model turns per episode")
    g.add_argument(
        "--max-episode-tokens", type=int, default=1024, help="most tokens per episode (prompt included)"
    )
    g.add_argument("--env-timeout", type=float, default=30.0, help="seconds per environment call")
    g.add_argument(
        "--env-option", action="append", help="KEY=VALUE for the environment's constructor (repeatable)"
    )
    p.set_defaults(func=cmd_generate)

    from exactrl import commands

    commands.register(sub)
    # The description names every subcommand registered above, so --help cannot drift from the parser.
    parser.description = "The `exactrl` command line: " + " | ".join(sub.choices) + "."

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        from exactrl.distributed.nodes import nodes_from_args

        nodes = nodes_from_args(args)
        if nodes is not None:
            roles = check_before_launch(args, nodes.world_size)
            if roles is not None:  # what each rank will do, once, before the ranks' own output
                from exactrl.distributed.roles import roles_line

                print(roles_line(nodes.world_size, roles, nodes.nproc_per_node), file=sys.stderr, flush=True)
            from exactrl.distributed.launch import launch_torchrun

            return launch_torchrun(nodes, argv)
        cap_host_threads(args)
        code = int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        _say_error(f"exactrl {args.command}{_rank_note()}: error: {e}", 2)
        return 2  # the process group is left to the exit: the other ranks may still be inside a collective
    except OSError as e:  # no space, no permission, a read-only disk: one line that names the path
        _say_error(f"exactrl {args.command}{_rank_note()}: error: {os_error_text(e)}", 1)
        return 1
    except Exception as e:
        from exactrl.distributed.heartbeat import write_rank_error

        # The guard's verdict reads the same on every rank (it names the ranks and the first token): one line.
        if type(e).__name__ == "MismatchError" and write_rank_error(f"exactrl {args.command}: {e}", 1):
            return 1
        # A crash (a bug): under exactrl's launcher its traceback is printed once, by the launcher; elsewhere it
        # propagates as ever (`record` files it for a plain torchrun).
        if write_rank_error(
            f"exactrl {args.command}{_rank_note()} failed:\n{traceback.format_exc().rstrip()}", 1
        ):
            return 1
        raise
    return _end_process_group() or code


def _rank_note() -> str:
    rank = os.environ.get("RANK")
    return f" (rank {rank})" if rank is not None else ""


def os_error_text(e: OSError) -> str:
    """An OS error in one line that names its path: an OutputError says what was being written; another error
    with a file name gives that name and the system's reason."""
    from exactrl.model.files import OutputError

    if isinstance(e, OutputError) or e.filename is None:
        return str(e)
    where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
    return f"{where}: {e.strerror or e}"


def _end_process_group() -> int:
    """Leave the process group a command under torchrun started (no-op otherwise), together: a barrier, then
    `leave_process_group` (which says why it pauses)."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # Every rank got here without an error (an error returns before this): leave together, so no rank tears
        # its transport down while a peer is still inside a collective. The allocator's cache goes back first: on
        # a GPU the barrier may need a little device memory of its own (NCCL), and a run that ends with the card's
        # memory cached (bench rl on 2 x H200, 2026-11-28) failed its barrier with "out of memory" after its work.
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # Whatever a command left to the cycle collector goes now, an engine's CUDA graphs among it: graphs
            # that captured NCCL collectives make destroy_process_group hang (`ModelRunner.release_graphs`).
            gc.collect()
            torch.cuda.empty_cache()
        try:
            dist.barrier()
        except Exception as e:  # a peer failed after this rank's work: its error is the one to report
            from exactrl.distributed.heartbeat import write_rank_error

            said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            text = f"exactrl: rank {os.environ.get('RANK')} lost a peer at the end of the run: {said}"
            if not write_rank_error(text, 1, kind="lost"):
                print(text, file=sys.stderr)
            return 1
        from exactrl.distributed.env import leave_process_group

        leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
