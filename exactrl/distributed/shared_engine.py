"""One rollout engine shared by a group of ranks (`engine.tensor_parallel = T`, `engine.expert_parallel = E`), as
`exactrl train` runs it under torchrun.

The job's W ranks split into W / G consecutive groups of G = max(T, E) ranks; each group holds one engine split
over it (exactrl/distributed/tensor_parallel.py, expert_parallel.py), its weights filled from the FSDP2 trainer's
shards by the weight sync (`CausalLM.shard_full_weight`). The trainer is untouched: every rank still trains on its
own share of the step's prompts, as at G = 1.

What the ranks of a group must do together is call the engine: the same prompts, request ids and sampling in the
same order (every forward runs collectives over the group). `SharedEngine.generate` makes one call of the group out
of each rank's own call: the ranks' shares are gathered (in rank order), the engine samples their union once, and
each rank keeps the outputs of its own prompts. A request's completions depend on (seed, request id) and on no
other request of the call (the engine is batch-invariant), so a rank gets the very tokens and logprobs its own
engine would have sampled at G = 1: the RL loop above it runs unchanged, and the guard checks every token of a
rank's share against the trainer as before.

Multi-turn episodes go the same way (`run_episodes`): the group's shares are gathered, every rank runs the union in
its engine in lockstep (exactrl/envs/rollout.py, "Lockstep"), each rank calling the environments of its own prompts
and trading its verdicts with the others once per turn round, and each keeps its own episodes: the ones its engine
would have run at G = 1, bit for bit.

A call that only some ranks make (the held-out evaluation, on rank 0) is a `round`: a rank of the group that asked
nothing in the round joins with an empty share when the round ends, so the group still makes one call together
(a generation or episodes, whichever the others asked for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from exactrl.distributed.expert_parallel import check_expert_parallel_shape, shard_experts
from exactrl.distributed.tensor_parallel import (
    TensorParallelGroup,
    check_tensor_parallel_shape,
    shard_engine_model,
    tensor_parallel_groups,
)
from exactrl.engine.engine import RequestOutput, RolloutEngine
from exactrl.engine.sampler import SamplingParams
from exactrl.envs.rollout import EnvSetup, EpisodeBatch, Lockstep, run_episodes
from exactrl.model.config import ModelConfig
from exactrl.model.qwen import CausalLM
from exactrl.tasks.base import Example


def engine_group_size(tensor_parallel: int, expert_parallel: int) -> int:
    """G: the ranks that share one engine. Tensor and expert parallel split the same group when both are on."""
    t, e = tensor_parallel, expert_parallel
    for key, size in (("engine.tensor_parallel", t), ("engine.expert_parallel", e)):
        if size < 1:  # the key that is wrong, alone
            raise ValueError(f"{key} = {size} must be at least 1")
    if t > 1 and e > 1 and t != e:
        raise ValueError(
            f"engine.tensor_parallel = {t} and engine.expert_parallel = {e}: both split one engine over the same "
            "ranks, so they must be equal when both are above 1"
        )
    return max(t, e)


def check_engine_split(cfg: ModelConfig, tensor_parallel: int, expert_parallel: int) -> int:
    """Refuse, by key, an engine split the model's shape does not allow (nothing built); returns G."""
    size = engine_group_size(tensor_parallel, expert_parallel)
    check_tensor_parallel_shape(cfg, tensor_parallel)
    check_expert_parallel_shape(cfg, expert_parallel)
    return size


def engine_group(
    rank: int, world_size: int, tensor_parallel: int, expert_parallel: int
) -> TensorParallelGroup:
    """This rank's engine group (every rank calls it: the groups are made collectively)."""
    return tensor_parallel_groups(rank, world_size, engine_group_size(tensor_parallel, expert_parallel))


def split_engine_model(
    model: CausalLM, group: TensorParallelGroup, tensor_parallel: int, expert_parallel: int
) -> CausalLM:
    """The engine's own full-weight model split over `group`, in place: tensor parallel, then the routed experts."""
    if tensor_parallel > 1:
        model = shard_engine_model(model, group)
    if expert_parallel > 1:
        model = shard_experts(model, group)
    return model


class _Share(NamedTuple):
    """One rank's part of a group call."""

    kind: str | None  # "generate" or "episodes"; None: a rank that joins a round with nothing to ask
    prompts: list[list[int]]
    request_ids: list[int]
    params: SamplingParams | None


class SharedEngine:
    """A rank's handle on the engine its group shares: `generate` and `run_episodes` take this rank's share and
    return its outputs (see the module docstring). env: the run's environment (multi-turn runs). The engine's own
    attributes the run reads (`model`, `config`, `runner`, `release_kv`) are the wrapped engine's."""

    def __init__(
        self, engine: RolloutEngine, group: TensorParallelGroup, env: EnvSetup | None = None
    ) -> None:
        self.engine = engine
        self.group = group
        self.env = env
        # Each rank sizes an unset KV cache from its own free memory: the group takes the smallest.
        engine.agree_blocks = group.min
        self._in_round = False
        self._asked = 0  # this rank's calls in the current round

    # -- the wrapped engine's attributes ---------------------------------------------------------------------
    @property
    def model(self) -> CausalLM:
        return self.engine.model

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def runner(self) -> Any:
        return self.engine.runner

    @property
    def stats(self) -> dict[str, float]:
        return self.engine.stats

    def release_kv(self) -> int:
        return self.engine.release_kv()

    # -- one call of the group -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | None,
        request_ids: list[int] | None = None,
        progress: Callable[[int], object] | None = None,
    ) -> list[RequestOutput]:
        """This rank's outputs of the group's one engine call on the union of every rank's prompts. Every rank of
        the group calls it (a rank with nothing to sample passes no prompts); request ids must be unique over the
        group (the loop's are the prompt's index in the step), and the ranks with prompts must pass equal
        sampling parameters."""
        ids = list(range(len(prompts))) if request_ids is None else list(request_ids)
        shares = self._gather(_Share("generate", [list(p) for p in prompts], ids, params))
        return self._generate(shares, progress)

    def run_episodes(
        self,
        examples: list[Example],
        prompt_ids: list[list[int]],
        params: SamplingParams,
        request_ids: list[int],
        progress: Callable[[int], object] | None = None,
    ) -> EpisodeBatch:
        """This rank's episodes (`exactrl.envs.run_episodes` against the run's environment) of the group's one
        lockstep run of every rank's prompts: every rank calls it, request ids unique over the group."""
        shares = self._gather(_Share("episodes", [list(p) for p in prompt_ids], list(request_ids), params))
        return self._episodes(shares, examples, progress)

    # -- the group's call, from the gathered shares -----------------------------------------------------------
    def _gather(self, share: _Share) -> list[_Share]:
        if self._in_round:
            if self._asked:
                raise RuntimeError("a round of a shared engine holds one call (the held-out evaluation's)")
            self._asked += 1
        return self.group.gather_objects(share if share.prompts else _Share(share.kind, [], [], None))

    def _params(self, shares: list[_Share], kind: str) -> SamplingParams | None:
        """The call's sampling parameters (None: no rank asked anything); refuses ranks that disagree."""
        asking = [s for s in shares if s.prompts]
        # Every share names its call, an empty one too (a rank joining a round names none): ranks that disagree all
        # raise here, none goes on into the other call's collectives.
        kinds = {r: s.kind for r, s in enumerate(shares) if s.kind is not None}
        if any(k != kind for k in kinds.values()):
            said = ", ".join(f"group rank {r} {k!r}" for r, k in kinds.items())
            raise RuntimeError(f"the ranks of a shared engine asked for different calls at once: {said}")
        if any(s.params != asking[0].params for s in asking):
            raise RuntimeError(
                "the ranks of a shared engine asked for different sampling parameters in one call"
            )
        return asking[0].params if asking else None

    def _mine(self, shares: list[_Share]) -> slice:
        """Where this rank's share lies in the union."""
        start = sum(len(s.prompts) for s in shares[: self.group.rank])
        return slice(start, start + len(shares[self.group.rank].prompts))

    def _generate(
        self, shares: list[_Share], progress: Callable[[int], object] | None = None
    ) -> list[RequestOutput]:
        params = self._params(shares, "generate")
        if params is None:
            return []
        union = [p for s in shares for p in s.prompts]
        union_ids = [i for s in shares for i in s.request_ids]
        outs = self.engine.generate(union, params, request_ids=union_ids)[self._mine(shares)]
        if progress is not None:
            progress(sum(len(o.samples) for o in outs))
        return outs

    def _episodes(
        self,
        shares: list[_Share],
        examples: list[Example],
        progress: Callable[[int], object] | None = None,
    ) -> EpisodeBatch:
        params = self._params(shares, "episodes")
        if params is None:
            return EpisodeBatch([], [])
        env = self.env
        if env is None:
            raise RuntimeError(
                f"rank {self.group.rank} of a shared engine: asked for episodes, but has no [env]"
            )
        union = [p for s in shares for p in s.prompts]
        mine = self._mine(shares)
        # The environments of this rank's prompts run here (their examples are this rank's); the others' only
        # step in this rank's engine.
        owned = [mine.start <= i < mine.stop for i in range(len(union))]
        union_examples: list[Any] = [None] * len(union)
        union_examples[mine] = examples
        return run_episodes(
            self.engine,
            self.engine.tokenizer,
            union_examples,
            union,
            env.make,
            env.settings,
            params,
            request_ids=[i for s in shares for i in s.request_ids],
            progress=progress,
            pool=env.pool() if examples else None,  # the environment's workers, on the ranks that call it
            lockstep=Lockstep(self.group.gather_objects, owned),
        )

    @contextmanager
    def round(self) -> Iterator[None]:
        """A round in which not every rank of the group may call `generate` or `run_episodes` (at most once each): one
        that did not joins with an empty share at its end, so the group makes its one call together."""
        self._in_round, self._asked = True, 0
        try:
            yield
        finally:
            self._in_round = False
        if not self._asked:  # join the others' call, whichever it is, with nothing of this rank's
            shares = self.group.gather_objects(_Share(None, [], [], None))
            kinds = {s.kind for s in shares} - {None}  # an empty share names its call too
            if kinds == {"episodes"}:
                self._episodes(shares, [])
            else:
                self._generate(shares)
