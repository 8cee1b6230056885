"""The disaggregated layout's two halves: the trainers' handle on their generator, and the generator's loop.

A trainer rank of a disaggregated run (`distributed.generator_ranks > 0`, exactrl/distributed/layout.py) runs the
RL step of the colocated run at world size N unchanged, except that its `engine` is a `RemoteEngine`: `generate`
ships the prompts and request ids to the generator that serves this trainer and returns that generator's request
outputs. Sampling is keyed by (seed, request, sample, position) and every kernel is batch-invariant, so the
outputs are the ones the trainer's own engine would have produced from the same weights: each trainer trains on
exactly the samples the colocated rank of the same number would, and metrics and weights come out bitwise equal.

A generator rank runs `serve_generator`: it makes the model (the same shape and dtype, empty), receives every weight
from trainer 0 before the first generation, then answers its trainers' commands round by round until they stop it.
Every trainer sends the same sequence of commands (a trainer with nothing to ask sends "skip"), so a generator that
serves several trainers receives one command from each per round, and runs one `generate` for all of them when
they ask with the same sampling parameters (one batch, the same bits).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from exactrl.config import RunConfig, resolve_device
from exactrl.distributed.env import rank_device
from exactrl.distributed.layout import Layout, recv_weights, send_weights
from exactrl.engine.engine import EngineConfig, RequestOutput, RolloutEngine
from exactrl.engine.partial import CutResult, CutRule, PartialSample, generate_until_cut
from exactrl.engine.sampler import SamplingParams
from exactrl.envs.rollout import EnvSetup, EpisodeBatch
from exactrl.model.precision import (
    fp8_receive_weight,
    fp8_sync_received,
    fp8_sync_targets,
    fp8_sync_tensors,
)
from exactrl.model.qwen import CausalLM


@dataclass
class Command:
    """One trainer's request of its generator for one round."""

    # "generate", "partial" (cut by count), "episodes" (multi-turn, against the environment), "sync" (receive
    # weights), "lora" (attach the adapters), "skip", "stop"
    kind: str
    prompts: list[list[int]] = field(default_factory=list)
    params: SamplingParams | None = None
    request_ids: list[int] | None = None
    names: list[str] = field(default_factory=list)  # "sync": the parameters broadcast, in order
    # "sync": what of each name is sent (`exactrl.model.precision.SYNC_KINDS`: the weight, or its fp8 values or
    # scales; empty: every name a weight)
    kinds: list[str] = field(default_factory=list)
    # "sync": the parameters' whole shapes (a split engine's rank receives them whole and keeps its slice)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    resumed: list[PartialSample] = field(default_factory=list)  # "partial": the samples carried in
    rule: CutRule | None = None  # "partial": when the generation stops
    # "episodes": the prompts' examples (the environment's input)
    examples: list[Any] = field(default_factory=list)


class RemoteEngine:
    """A trainer rank's engine in the disaggregated layout: `generate` runs on its generator. Also the holder of
    the trainer's weight replica (`model`, set once the trainer is built), which checkpoints export and whose
    tensors trainer 0 broadcasts to the generators."""

    runner = None  # no decode graphs here (MemoryPhases reads it)

    def __init__(self, layout: Layout, config: EngineConfig) -> None:
        self.layout = layout
        self.config = config
        self.model: torch.nn.Module | None = None
        # The rank that answers, and every rank of its engine (each gets the commands).
        self.peer = layout.generator_of(layout.local.rank)
        self.peers = layout.generators_of(layout.local.rank)
        self._asked = False  # whether this round's command went out (`end_round`)
        self.last_send: dict[str, float] = {}

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        request_ids: list[int] | None = None,
        progress: Any = None,
    ) -> list[RequestOutput]:
        ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        outs = self._ask(Command("generate", [list(p) for p in prompts], params, ids))
        if progress is not None:
            progress(sum(len(o.samples) for o in outs))
        return outs

    def generate_until_cut(
        self,
        prompts: list[list[int]],
        request_ids: list[int],
        params: SamplingParams,
        resumed: list[PartialSample],
        rule: CutRule,
    ) -> CutResult:
        """Partial rollouts: this trainer's generation, cut by its own count, run on its generator as this rank's
        colocated engine would run it (`exactrl.engine.partial.generate_until_cut`)."""
        return self._ask(
            Command(
                "partial", [list(p) for p in prompts], params, list(request_ids), resumed=resumed, rule=rule
            )
        )

    def run_episodes(
        self,
        examples: list[Any],
        prompt_ids: list[list[int]],
        params: SamplingParams,
        request_ids: list[int],
    ) -> EpisodeBatch:
        """Multi-turn: this trainer's episodes, run on its generator against the generator's own instance of the
        run's environment, as `exactrl.envs.run_episodes` runs them on a colocated rank's engine."""
        return self._ask(
            Command(
                "episodes", [list(p) for p in prompt_ids], params, list(request_ids), examples=list(examples)
            )
        )

    def _tell(self, cmd: Command) -> None:
        """`cmd` to every rank of this trainer's engine."""
        for p in self.peers:
            self.layout.send(cmd, p)

    def _ask(self, cmd: Command) -> Any:
        """This round's command to the generator, and its answer."""
        self._tell(cmd)
        self._asked = True
        return self.layout.recv(self.peer)

    def release_kv(self) -> int:
        return 0  # no KV cache on a trainer

    def begin_round(self) -> None:
        self._asked = False

    def end_round(self) -> None:
        """A round where this trainer may not have asked anything (the held-out evaluation runs on trainer 0's
        generator alone): a "skip" keeps the generator's rounds in step."""
        if not self._asked:
            self._tell(Command("skip"))
        self._asked = False

    @torch.no_grad()
    def push(self, named: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Every trainer: tell the generator new weights come; trainer 0: broadcast `named` (model-dtype tensors,
        the same names and order on every trainer) to every generator. An fp8 projection of the replica (`model`)
        goes as its fp8 values and scales (`fp8_sync_tensors`: about half the bytes)."""
        t0 = time.perf_counter()
        sent = fp8_sync_tensors(self.model, named)
        names, kinds = [n for n, _, _ in sent], [k for _, k, _ in sent]
        self._tell(Command("sync", names=names, kinds=kinds, shapes=[tuple(t.shape) for _, _, t in sent]))
        moved = 0
        if self.layout.local.rank == 0:
            moved = send_weights([t for _, _, t in sent], self.layout.sync_group)
            if sent and sent[0][2].is_cuda:
                torch.cuda.synchronize(sent[0][2].device)
        dt = time.perf_counter() - t0
        self.last_send = {"time/weight_send_s": dt}
        if moved:
            self.last_send["perf/weight_send_gb_per_s"] = moved / max(dt, 1e-9) / 1e9
        return self.last_send

    def attach_lora(self) -> None:
        """Every trainer, once its policy has its adapters (after the warm start and the evaluation before RL, as
        a colocated run builds its replica's engine): the generator attaches the same adapters to its model. Their
        values come with the next full weight sync."""
        self._tell(Command("lora"))

    def stop(self) -> None:
        self._tell(Command("stop"))


def serve_generator(cfg: RunConfig, layout: Layout, env: EnvSetup | None = None) -> dict[str, Any]:
    """A generator rank's whole job: make the model (its weights come with the first sync), then answer the
    trainers until they stop. env: the run's environment (multi-turn: the episodes run here). Returns an empty
    summary (rank 0, a trainer, writes the run's)."""
    # The trainers stop the run (and checkpoint) on a signal; a generator waits for their "stop" instead of dying
    # under them (torchrun's agent passes every signal on to every rank).
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(sig, lambda *_: None)
        except ValueError:
            break
    run_generator(cfg, layout, env)
    return {}


def run_generator(
    cfg: RunConfig,
    layout: Layout,
    env: EnvSetup | None = None,
    make: Callable[..., RolloutEngine] = RolloutEngine,
) -> GeneratorLoop:
    """Check the generator's memory plan, make its engine (`generator_engine`, with the plan's KV cache on a GPU)
    and serve the trainers until they stop; the loop (its rounds) is returned. The decode graphs go before the
    process group does (`ModelRunner.release_graphs`), an error's way out included. make: as `generator_engine`'s."""
    # Before the model is made: an engine whose weights, cache and transients cannot fit this GPU is refused now,
    # naming the knobs (the trainers check their own plan in RLRun); the first generator rank says the plan.
    from exactrl.train.memory_generator import check_generator_before_loading

    device = rank_device(layout.world, resolve_device(cfg.run.device))
    first = layout.world.rank == layout.trainers
    plan = check_generator_before_loading(
        cfg, str(device), layout.world.world_size, out=print if first else (lambda *a: None)
    )
    # On a GPU the engine holds the plan's cache (as a colocated run's MemoryPhases gives it), so the plan holds
    # whatever the calls: a larger one (trainer 0's held-out evaluation) runs in it instead of growing it.
    # (An unchecked plan, train.check_memory = false, may not fit: the engine then sizes itself.)
    kv_blocks = plan.counts["kv_blocks"] if plan is not None and cfg.train.check_memory else None
    loop = GeneratorLoop(
        generator_engine(cfg, layout, make, kv_blocks=kv_blocks),
        layout,
        lora=cfg.lora,
        seed=cfg.run.seed,
        env=env,
    )
    try:
        loop.serve()
    finally:
        if loop.engine.runner is not None:
            loop.engine.runner.release_graphs()
    return loop


def generator_engine(
    cfg: RunConfig,
    layout: Layout,
    make: Callable[..., RolloutEngine] = RolloutEngine,
    kv_blocks: int | None = None,
) -> RolloutEngine:
    """The generator's engine: the run's model shape and dtype on this rank's device, in the exact environment the
    trainers set, split over the rank's engine group when engine.tensor_parallel / expert_parallel share it. Every
    weight comes from trainer 0 before the first generation, so the model is made as its structure (no random draws,
    no checkpoint read, never the whole model on a rank of a split engine) and given memory once split; the loop
    refuses to generate before every weight has arrived. make: the engine class (or a factory with its signature;
    `exactrl bench rl` plans completion lengths). kv_blocks: the KV cache's size from the generator's memory plan
    (agreed over a split engine's group: the least), where engine.num_kv_blocks is unset; None: sized per call from
    free memory."""
    from exactrl.model.loading import policy_structure
    from exactrl.model.precision import empty_fp8_only
    from exactrl.ops import set_exact_environment

    device = rank_device(layout.world, resolve_device(cfg.run.device))
    set_exact_environment(cfg.run.exact)
    torch.manual_seed(cfg.run.seed)
    if cfg.run.exact:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # (A module attribute torch sets at runtime; its stubs do not declare it.)
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    model, tok = policy_structure(
        preset_name=cfg.model.preset,
        path=cfg.model.path,
        device=device,
        dtype=cfg.model.dtype,
        exact=cfg.run.exact,
        fp32_lm_head=cfg.model.fp32_lm_head,
        tokenizer_path=cfg.model.tokenizer,
    )
    group = getattr(layout, "engine_group", None)
    if group is not None:
        from exactrl.distributed.shared_engine import split_engine_model

        model = split_engine_model(model, group, cfg.engine.tensor_parallel, cfg.engine.expert_parallel)
    # fp8: each projection is held as its fp8 copy alone (no model-dtype weight), which the sync sends or
    # quantizes on arrival (`sync_put`); nothing to quantize before the weights come.
    model = empty_fp8_only(model, device, cfg.model.precision).requires_grad_(False)
    engine_cfg = replace(cfg.engine, kv_memory_fraction=cfg.distributed.generator_kv_memory_fraction)
    if kv_blocks is not None and not cfg.engine.num_kv_blocks:
        # Each rank planned from its own device's memory; the ranks of one engine must hold the same cache.
        engine_cfg.num_kv_blocks = kv_blocks if group is None else group.min(kv_blocks)
    engine = make(model, engine_cfg, tokenizer=tok)
    if group is not None:
        # Each rank sizes an unset KV cache from its own free memory: the group takes the least.
        engine.agree_blocks = group.min
    return engine


def sync_put(
    model: CausalLM,
    params: Mapping[str, torch.Tensor],
    names: list[str],
    kinds: list[str],
    targets: list[torch.Tensor],
) -> Callable[[int, torch.Tensor], None]:
    """A generator's `recv_weights` put: where whole tensor i (of `names[i]`, a view of the sync's bucket) goes.
    What of it `model` holds (all of it, or a split engine's slice, of an fp8 copy's values or scales too: every
    split cuts rows, which the copy keeps per row) is copied into its target (`fp8_sync_targets`); an fp8
    projection sent as its model-dtype weight, which `model` holds as its fp8 copy alone, is quantized into the
    copy at once (`fp8_receive_weight`: one weight at a time, out of the bucket)."""

    def put(i: int, whole: torch.Tensor) -> None:
        if kinds[i] == "weight" and fp8_receive_weight(model, params, names[i], whole):
            return
        targets[i].copy_(model.shard_full_weight(names[i], whole))

    return put


@dataclass
class Round:
    """What a generator did in one round, by wall clock (time.time(): comparable with the trainers' on one host)."""

    kind: str  # "generate" or "sync"
    start: float  # the work's start (after the commands arrived)
    end: float
    # Completion tokens generated (a split engine's follower in a multi-turn round: 0, the episodes are its first
    # rank's, which answers; a generation's every rank counts the group's call).
    tokens: int = 0
    bytes: int = 0  # weight bytes received
    # The engine's steps and preemptions in the round, and its KV cache after it (tokens).
    engine_steps: int = 0
    preemptions: int = 0
    kv_cache_tokens: int = 0


class GeneratorLoop:
    """One generator's rounds: a command from each of its trainers, then the work they ask for. `rounds` keeps
    what each round did (`exactrl bench rl` reads it)."""

    def __init__(
        self,
        engine: RolloutEngine,
        layout: Layout,
        lora: Any = None,
        seed: int = 0,
        env: EnvSetup | None = None,
    ) -> None:
        self.engine = engine
        self.env = env  # multi-turn: the run's environment, whose episodes this generator runs
        self.layout = layout
        self.trainers = layout.trainers_of(layout.world.rank)
        # The rank that sends the outputs back (a split engine's other ranks run the same calls and keep quiet).
        self.answers = layout.answers(layout.world.rank)
        self.params = dict(engine.model.named_parameters())
        # The weights no sync has filled yet (the engine's model is made empty, `generator_engine`).
        self.unfilled = set(self.params)
        self.rounds: list[Round] = []
        self.lora, self.seed = lora, seed  # the run's [lora] section: the adapters a "lora" command attaches

    def attach_lora(self) -> None:
        """The trainers' adapters on this generator's model (the same modules and names, so the weight sync finds
        them), with a new runner: the old one's decode graphs were captured without them."""
        from exactrl.model.lora import apply_lora_config

        if self.lora is None or self.lora.rank == 0:
            raise RuntimeError(
                f"generator rank {self.layout.world.rank}: asked for adapters it has no [lora] for"
            )
        apply_lora_config(
            self.engine.model, replace(self.lora, path=None), seed=self.seed
        )  # values: the sync's
        from exactrl.distributed.tensor_parallel import shard_adapters

        # A split engine: B's rows are its projection's, and the sync slices the whole B it sends.
        shard_adapters(self.engine.model)
        if self.engine.runner is not None:
            self.engine.runner.release_graphs()
        self.engine.runner = None
        before = self.params
        self.params = dict(self.engine.model.named_parameters())
        self.unfilled |= set(self.params) - set(before)  # the adapters: their values come with the next sync

    def serve(self) -> None:
        while True:
            cmds = [self.layout.recv(r) for r in self.trainers]
            kinds = {c.kind for c in cmds}
            if "stop" in kinds:
                return
            if kinds == {"lora"}:
                self.attach_lora()
                continue
            t0 = time.time()
            if kinds == {"sync"}:
                names = cmds[0].names
                what = cmds[0].kinds or ["weight"] * len(names)
                missing = [n for n in names if n not in self.params]
                if missing:
                    raise RuntimeError(
                        f"generator rank {self.layout.world.rank} has no parameter {missing[0]!r}"
                    )
                targets = fp8_sync_targets(self.engine.model, self.params, names, what)
                moved = recv_weights(
                    targets,
                    self.layout.sync_group,
                    shapes=cmds[0].shapes or None,
                    put=sync_put(self.engine.model, self.params, names, what, targets),
                )
                fp8_sync_received(self.engine.model, self.params, names, what)
                self.unfilled -= set(names)  # (fp8: every copy set as it arrived, before any graph replays)
                self.rounds.append(Round("sync", t0, time.time(), bytes=moved))
                continue
            if kinds & {"sync", "lora"}:
                raise RuntimeError(
                    f"generator rank {self.layout.world.rank}: a weight sync out of step ({kinds})"
                )
            asks = [(r, c) for r, c in zip(self.trainers, cmds) if c.kind == "generate"]
            cuts = [(r, c) for r, c in zip(self.trainers, cmds) if c.kind == "partial"]
            eps = [(r, c) for r, c in zip(self.trainers, cmds) if c.kind == "episodes"]
            if (asks or cuts or eps) and self.unfilled:
                raise RuntimeError(
                    f"generator rank {self.layout.world.rank}: asked to generate before the weight sync filled "
                    f"{len(self.unfilled)} of its parameters (e.g. {sorted(self.unfilled)[0]!r})"
                )
            if asks or cuts or eps:
                before = dict(self.engine.stats)
                tokens = self.generate(asks) + self.generate_until_cut(cuts) + self.run_episodes(eps)
                runner = self.engine.runner
                self.rounds.append(
                    Round(
                        "generate",
                        t0,
                        time.time(),
                        tokens=tokens,
                        engine_steps=int(self.engine.stats["steps"] - before["steps"]),
                        preemptions=int(self.engine.stats["preemptions"] - before["preemptions"]),
                        kv_cache_tokens=0 if runner is None else runner.num_blocks * runner.block_size,
                    )
                )

    def generate_until_cut(self, asks: list[tuple[int, Command]]) -> int:
        """Partial rollouts: each trainer's generation cut by its own count, one after the other. Not one call for
        all: where the cut falls depends on which samples share the engine's steps, so each trainer's generation
        must be the one its colocated engine would run alone (the tokens' bits would match either way; the cut
        would not). Returns the completion tokens sampled."""
        tokens = 0
        for r, c in asks:
            assert c.params is not None and c.rule is not None and c.request_ids is not None
            out = generate_until_cut(self.engine, c.prompts, c.request_ids, c.params, c.resumed, c.rule)
            tokens += sum(len(s.completion_ids) for s in out.samples)
            tokens -= sum(len(s.completion_ids) for s in c.resumed)
            self._answer(out, r)
        return tokens

    def run_episodes(self, asks: list[tuple[int, Command]]) -> int:
        """Multi-turn: each trainer's episodes, one call after the other, as its colocated engine would run them
        (an episode's environment calls and reward are keyed by its example and sample, its sampling by its
        request id); each trainer gets its `EpisodeBatch`. Returns the tokens the episodes hold after their
        prompts (model turns and observations): the first rank's, which holds them; 0 on a follower. A split
        engine's ranks run each call in lockstep (exactrl/envs/rollout.py, "Lockstep"): the first rank, which
        answers, calls every environment, the others follow its verdicts."""
        from exactrl.envs.rollout import Lockstep, run_episodes

        group = getattr(self.layout, "engine_group", None)
        tokens = 0
        for r, c in asks:
            if self.env is None:
                raise RuntimeError(
                    f"generator rank {self.layout.world.rank}: asked for episodes, but the run has no [env]"
                )
            assert c.params is not None
            eb = run_episodes(
                self.engine,
                self.engine.tokenizer,
                c.examples,
                c.prompts,
                self.env.make,
                self.env.settings,
                c.params,
                request_ids=c.request_ids,
                pool=self.env.pool() if self.answers else None,  # started once for the run, on this rank
                lockstep=None
                if group is None
                else Lockstep(group.gather_objects, [self.answers] * len(c.prompts)),
            )
            tokens += sum(len(e.completion_ids) for g in eb.groups for e in g)
            self._answer(eb, r)
        return tokens

    def generate(self, asks: list[tuple[int, Command]]) -> int:
        """One `generate` over every trainer's prompts that share sampling parameters (batch-invariant: the same
        bits as one call each), each trainer's outputs sent back to it. Returns the completion tokens."""
        tokens = 0
        while asks:
            params = asks[0][1].params
            assert params is not None  # a generate command carries its sampling parameters
            same = [(r, c) for r, c in asks if c.params == params]
            asks = [(r, c) for r, c in asks if c.params != params]
            prompts = [p for _, c in same for p in c.prompts]
            ids = [i for _, c in same for i in (c.request_ids or [])]
            outs = self.engine.generate(prompts, params, request_ids=ids)
            tokens += sum(len(s.token_ids) for o in outs for s in o.samples)
            start = 0
            for r, c in same:
                self._answer(outs[start : start + len(c.prompts)], r)
                start += len(c.prompts)
        return tokens

    def _answer(self, obj: Any, trainer: int) -> None:
        if self.answers:
            self.layout.send(obj, trainer)
