"""One-step-off RL without mismatch (algorithm.max_off_policy_steps = 1): the pieces the loop's stages use.

On one device the engine samples the next batch from its own weight copy (`BehaviourPolicy`, in the model dtype,
like the FSDP engine replica) in a worker thread (`GenerationWorker`) while the trainer updates the policy on this
batch; after the update the copy is refreshed in place (same tensors: CUDA graphs keep their addresses). So the
batch trained at step t was sampled by policy t - 1 (the first by policy 0): every token carries that version,
and its recorded logprob is the *exact* behaviour logprob.

Why the recorded logprobs are exact: the copy holds the bits of the policy at its version (a copy, no cast: both
are in the model dtype), and every kernel is batch-invariant and deterministic, so sampling from the copy in
another thread records what the trainer's forward of that version computes; which thread or stream runs a kernel
does not change its arithmetic. The guard proves it per batch (`check_batch`). (The run itself is not the
synchronous run: it trains on batches one version older, by design; same seed, same run.)

The guard off-policy: before the copy is refreshed, the batch it sampled is scored through the *training* forward
of the copy and compared with the recorded logprobs (`torch.equal` per token). That costs one no-grad forward
over the batch per step (the synchronous loop checks for free inside its first training forward, which off-policy
runs at newer weights); it runs in the worker after generation, so it overlaps the update as well.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from exactrl.algorithms import mismatch_metrics
from exactrl.model.qwen import CausalLM
from exactrl.train.packing import packed_microbatches, response_logprobs
from exactrl.train.trainer import MismatchError, Rollout


class BehaviourPolicy:
    """The engine's own weights: a copy of the policy in the model dtype, at one policy version.

    `version` counts the optimizer steps the copied weights had taken (the loop's step index when copied). The
    copy is refreshed in place (`refresh`), so the engine's CUDA graphs and the KV cache stay valid. Memory: one
    more set of weights in the model dtype (2 bytes a parameter in bf16)."""

    def __init__(self, policy: CausalLM, version: int = 0) -> None:
        self.model: CausalLM = copy.deepcopy(policy).requires_grad_(False)
        self.version = version
        mine = dict(self.model.named_parameters())
        # Paired now, before the trainer wraps its modules (activation checkpointing): the tensors stay the same.
        self._pairs: list[tuple[torch.Tensor, torch.nn.Parameter]] = []
        self._trained: list[tuple[torch.Tensor, torch.nn.Parameter]] = []
        for name, p in policy.named_parameters():
            if name not in mine:
                raise RuntimeError(f"the behaviour copy has no parameter {name!r}")
            self._pairs.append((mine[name], p))
            if p.requires_grad:  # a LoRA base never steps: only what trains moves after a step
                self._trained.append((mine[name], p))

    @torch.no_grad()
    def refresh(self, version: int, *, full: bool = False) -> float:
        """Copy the policy's weights into the copy in place (every weight with `full`, after a checkpoint load);
        returns the seconds it took."""
        t0 = time.perf_counter()
        for mine, theirs in self._pairs if full else self._trained:
            mine.copy_(theirs.detach())
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.version = version
        return time.perf_counter() - t0

    @torch.no_grad()
    def refresh_from(self, other: BehaviourPolicy) -> None:
        """Every weight of `other`'s model (the same architecture) copied into this copy, in place, with its
        version."""
        theirs = dict(other.model.named_parameters())
        for name, mine in self.model.named_parameters():
            mine.copy_(theirs[name])
        self.version = other.version

    @torch.no_grad()
    def score(self, rollouts: list[Rollout], temperature: float, max_tokens: int) -> list[torch.Tensor]:
        """Per rollout, its completion tokens' logprobs [C] fp32 (CPU) under the copy's weights, through the
        training forward (packed microbatches, the trainer's path)."""
        seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
        plens = [len(r.prompt_ids) for r in rollouts]
        out: list[torch.Tensor | None] = [None] * len(rollouts)
        for mb, pb in packed_microbatches(seqs, plens, max_tokens, self.model.device):
            lp, _, sidx = response_logprobs(self.model, pb, temperature)
            for j, i in enumerate(mb):
                out[i] = lp[sidx == j].float().cpu()
        return [x for x in out if x is not None]


@dataclass
class BehaviourBatch:
    """A batch sampled and scored by one policy version, checked by the guard, waiting for its update."""

    sr: Any  # the loop's StepRollouts (rewards and advantages set)
    version: int  # the policy version that sampled every token of it
    versions: list[torch.Tensor]  # per rollout, [C] int64: the version that sampled each completion token
    generate_s: float  # seconds of its prompts -> rollout -> score, wherever it ran
    model_tokens: int  # the model's sampled tokens over the step (the loop's step_model_tokens)
    guard: dict[str, float] = field(default_factory=dict)  # mismatch/* of the guard, behaviour weights
    guard_s: float = 0.0
    mismatch: MismatchError | None = None  # the guard's verdict when a token differs
    report: Any = None  # the replay report's path, written while the copy still held the behaviour weights
    # Partial rollouts: what the guard scored (the tokens the copy sampled, in this batch and in the samples carried
    # on; the replay report's sequences index it; None: the batch's rollouts), and the generation's own metrics.
    checked: list[Rollout] | None = None
    partial: dict[str, float] = field(default_factory=dict)
    # Disaggregated one step off: the rank's sample whose guard is deferred to the step that trains on it (None:
    # checked; `OneStepOffDriver.finish_guard`).
    unchecked: Any = None


PENDING_FILE = "offpolicy_pending.json"


def _encode(x: Any) -> Any:
    """JSON of a pending batch's values, lossless: a float32 value is exact as a Python float and back."""
    if isinstance(x, torch.Tensor):
        return {"tensor": x.tolist(), "dtype": str(x.dtype).removeprefix("torch.")}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"dataclass": {f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}}
    if isinstance(x, list | tuple):
        return [_encode(v) for v in x]
    if isinstance(x, dict):
        return {"dict": {k: _encode(v) for k, v in x.items()}}
    return x


def _decode(x: Any, cls: type | None = None) -> Any:
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "tensor" in x:
        return torch.tensor(x["tensor"], dtype=getattr(torch, x["dtype"]))
    if "dict" in x:
        return {k: _decode(v) for k, v in x["dict"].items()}
    fields = x["dataclass"]
    # The batch's step rollouts are the caller's class; every nested dataclass in it is a Rollout.
    return (cls or Rollout)(**{k: _decode(v) for k, v in fields.items()})


def save_pending(directory: Path, batch: BehaviourBatch) -> None:
    """Write the batch sampled ahead (checked by the guard, waiting for the next step) into a checkpoint: a resume
    trains on it as the uninterrupted run would. A batch the guard refused is not written (a resume samples its
    step again from the checkpoint's weights)."""
    if batch.mismatch is not None:
        return
    d = {
        "sr": _encode(batch.sr)["dataclass"],
        "version": batch.version,
        "versions": _encode(batch.versions),
        "generate_s": batch.generate_s,
        "model_tokens": batch.model_tokens,
        "guard": batch.guard,
        "guard_s": batch.guard_s,
    }
    if batch.partial:
        d["partial"] = batch.partial
    (directory / PENDING_FILE).write_text(json.dumps(d) + "\n")


def load_pending(directory: Path, step_rollouts_cls: type) -> BehaviourBatch | None:
    """The batch a checkpoint holds (`save_pending`), or None when it holds none."""
    path = directory / PENDING_FILE
    if not path.is_file():
        return None
    d = json.loads(path.read_text())
    sr = step_rollouts_cls(**{k: _decode(v) for k, v in d["sr"].items()})
    return BehaviourBatch(
        sr=sr,
        version=d["version"],
        versions=_decode(d["versions"]),
        generate_s=d["generate_s"],
        model_tokens=d["model_tokens"],
        guard=d["guard"],
        guard_s=d["guard_s"],
        partial=d.get("partial", {}),
    )


def check_batch(
    policy: BehaviourPolicy, rollouts: list[Rollout], temperature: float, max_tokens: int
) -> tuple[dict[str, float], MismatchError | None]:
    """The guard off-policy: every model token's recorded logprob against the training forward of the behaviour
    weights (the copy, before it is refreshed). Returns the mismatch metrics and, when a token differs, the
    MismatchError that names the first one (with the offending sequences for the replay report). No rollouts (a
    generation that sampled nothing new): nothing to compare, zero counts."""
    if not rollouts:
        none = torch.zeros(0, 0)
        return mismatch_metrics(none, none, none.bool()), None
    scored = policy.score(rollouts, temperature, max_tokens)
    L = max(len(r.completion_ids) for r in rollouts)
    rl = torch.zeros(len(rollouts), L)
    tl = torch.zeros(len(rollouts), L)
    mask = torch.zeros(len(rollouts), L, dtype=torch.bool)
    for i, (r, t) in enumerate(zip(rollouts, scored)):
        n = len(r.completion_ids)
        rl[i, :n], tl[i, :n] = r.rollout_logprobs, t
        mask[i, :n] = True if r.loss_mask is None else torch.tensor(r.loss_mask, dtype=torch.bool)
    metrics = mismatch_metrics(rl, tl, mask)
    bad = []
    for i, r in enumerate(rollouts):
        diff = ((rl[i] != tl[i]) & mask[i]).nonzero()
        if diff.numel():
            n = len(r.completion_ids)
            bad.append((i, int(diff[0, 0]), rl[i, :n].clone(), tl[i, :n].clone()))
    if not bad:
        return metrics, None
    i, p, r_lp, t_lp = bad[0]
    ro = rollouts[i]
    msg = (
        f"{int(metrics['mismatch/num_mismatched_tokens'])} of {int(metrics['mismatch/num_tokens'])} rollout "
        f"logprobs differ from the trainer's forward of the behaviour weights (policy version {policy.version}); "
        f"first: rollout {i} (request {ro.request_id}, sample {ro.sample_index}), completion position {p}, token id "
        f"{ro.completion_ids[p]}: engine {float(r_lp[p]).hex()} ({float(r_lp[p]):.9g}), trainer "
        f"{float(t_lp[p]).hex()} ({float(t_lp[p]):.9g})"
    )
    return metrics, MismatchError(msg, bad)


def staleness_metrics(
    batch: BehaviourBatch, policy_version: int, masks: list[torch.Tensor], mixed: bool = False
) -> dict[str, float]:
    """How many versions behind the trained policy the batch's tokens are: per token (over the model's tokens,
    masks[i]: [C] bool) and per sequence (a sequence's mean over its tokens), and the largest.

    mixed (partial rollouts, where one sequence's tokens may come from several versions): also per sequence its
    oldest token (what the staleness bound limits), how many sequences span more than one version, and the oldest
    version in the batch (`behaviour_version` is then the newest: the copy that finished the batch)."""
    behind = [(policy_version - v[m]).double() for v, m in zip(batch.versions, masks)]
    tokens = torch.cat(behind) if behind else torch.zeros(0, dtype=torch.float64)
    seqs = torch.stack([b.mean() for b in behind if b.numel()]) if behind else tokens
    out = {
        "offpolicy/versions_behind/token_mean": float(tokens.mean()) if tokens.numel() else 0.0,
        "offpolicy/versions_behind/seq_mean": float(seqs.mean()) if seqs.numel() else 0.0,
        "offpolicy/versions_behind/max": float(tokens.max()) if tokens.numel() else 0.0,
        "offpolicy/behaviour_version": float(batch.version),
    }
    if mixed:
        oldest = [float(b.max()) for b in behind if b.numel()]
        spans = [int(b.max() != b.min()) for b in behind if b.numel()]
        out["offpolicy/versions_behind/seq_oldest_mean"] = sum(oldest) / len(oldest) if oldest else 0.0
        out["offpolicy/mixed_version_seqs"] = float(sum(spans))
        out["offpolicy/behaviour_version_oldest"] = float(policy_version - max(oldest, default=0.0))
    return out


class GenerationWorker:
    """Runs one job (the next batch's generation) in a background thread while the caller trains.

    On CUDA the job runs on a stream of its own, so its kernels overlap the trainer's (a thread alone would queue
    them behind the training kernels on the default stream); it waits for the work queued before `start` (the
    refreshed copy) and the caller's stream waits for the job's work at `result`. priority: the stream's CUDA
    priority (0 = default, lower = higher: the GPU schedules its kernels first when both streams have work)."""

    def __init__(self, device: torch.device | str, priority: int = 0) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # set_device needs the index
            self.device = torch.device("cuda", torch.cuda.current_device())
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device, priority=priority) if cuda else None
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, job: Callable[[], Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("the generation worker is already running a job")
        self._result, self._error = None, None
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

        def run() -> None:
            try:
                if self.stream is not None:
                    torch.cuda.set_device(self.device)  # the current device is per thread
                    with torch.cuda.stream(self.stream):
                        self._result = job()
                    self.stream.synchronize()
                else:
                    self._result = job()
            except BaseException as err:  # handed to the caller at result()
                self._error = err

        self._thread = threading.Thread(target=run, name="exactrl-generation", daemon=True)
        self._thread.start()

    def result(self) -> Any:
        """Wait for the job; its return value, or its exception raised here."""
        if self._thread is None:
            raise RuntimeError("the generation worker has no job")
        self._thread.join()
        self._thread = None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        out, self._result = self._result, None
        return out

    def close(self) -> None:
        """Wait for a job still running (an update failed under it) and drop its result."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._result = self._error = None
