"""`exactrl parity --replay DIR`: recompute both sides of a mismatch report from its weights, and say where they
diverge.

Per recorded sequence:
1. the engine re-generates the request (same seed, request id, sample index, sampling parameters) from the
   report's policy/ and must draw the recorded tokens (the noise is keyed on those, never on the batch);
2. the trainer's path (`completion_logprobs`, packed microbatches of the run's budget) scores the recorded tokens;
3. the recomputed engine logprobs are compared with the recomputed trainer logprobs (a divergence that replays:
   a kernel, a model option, a path that differs), and each side with what the run recorded (a recorded value
   that does not reproduce points at the run's machine or state: a fault that did not happen again);
4. where the recomputed sides differ, the layer probe (exactrl.train.layer_probe) names the first differing layer; in a
   mixture-of-experts layer, whether the router picked different experts (which token, which experts) or the same
   experts gave different bits (which expert).

Any difference left (tokens, recomputed divergence, a recorded value that does not reproduce) is a failure.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from exactrl.train.mismatch_report import RecordedSequence, read_mismatch_report


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First index where two fp32 vectors are not bitwise equal (NaN counts as different); over the shorter
    length, then a length difference counts at the end of the shorter."""
    n = min(a.numel(), b.numel())
    d = (a[:n] != b[:n]).nonzero()
    if d.numel():
        return int(d[0, 0])
    return None if a.numel() == b.numel() else n


def _hex(t: torch.Tensor, i: int) -> str:
    x = float(t[i])
    return f"{x.hex()} ({x!r})"


@dataclass
class SequenceReplay:
    """What replaying one recorded sequence showed. Positions are completion token indices; None = no difference."""

    request_id: int
    sample_index: int
    num_tokens: int
    recorded_first: int | None
    """Where the run's recorded rollout and trainer logprobs first differ."""
    token_first: int | None
    """Where the engine's re-sampled tokens first differ from the recorded ones."""
    recompute_first: int | None
    """Where the recomputed engine and trainer logprobs first differ (on the engine's re-sampled tokens)."""
    rollout_first: int | None
    """Where the recorded rollout logprobs first differ from the recomputed engine's (common tokens only)."""
    trainer_first: int | None
    """Where the recorded trainer logprobs first differ from the recomputed trainer's."""
    lines: list[str] = field(default_factory=list)
    layer: int | None = None
    layer_note: str | None = None
    experts: dict | None = None
    """A sparse first differing layer: `exactrl.train.layer_probe.ExpertProbe` as a dict (finding, position, token_id,
    engine_experts, trainer_experts, expert)."""

    @property
    def ok(self) -> bool:
        return (
            self.token_first is None
            and self.recompute_first is None
            and self.rollout_first is None
            and self.trainer_first is None
        )


@dataclass
class ReplayResult:
    report_dir: str
    step: int
    device: str
    dtype: str
    mode: str
    sequences: list[SequenceReplay]

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.sequences)

    def to_dict(self) -> dict:
        return asdict(self) | {"ok": self.ok}

    def text(self) -> str:
        head = (
            f"replay of {self.report_dir} (step {self.step}; {self.mode} mode, {self.dtype}, {self.device}): "
            f"{len(self.sequences)} sequences"
        )
        return "\n".join([head, *(line for s in self.sequences for line in s.lines)])


def replay_report(
    report_dir: str | Path,
    *,
    device: str | None = None,
    exact: bool = True,
    probe: bool = True,
) -> ReplayResult:
    """Recompute every recorded sequence of a mismatch report (see the module docstring). device: None = the
    run's run.device; exact: the kernels to replay with (the guard runs in exact mode)."""
    from exactrl.config import load_config
    from exactrl.engine.engine import RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.model.loading import load_policy
    from exactrl.ops import set_exact_environment
    from exactrl.train.packing import completion_logprobs

    d = Path(report_dir)
    rep, recorded = read_mismatch_report(d)
    cfg = load_config(d / "config.toml")
    policy = d / rep.get("policy", "policy")
    if not (policy / "config.json").is_file():
        raise FileNotFoundError(f"{d}: the report's weights are missing (no {policy}/config.json)")
    set_exact_environment(exact)
    model, tok = load_policy(
        path=policy,
        device=device or cfg.run.device,
        dtype=rep.get("model", {}).get("dtype", cfg.model.dtype),
        exact=exact,
        fp32_lm_head=cfg.model.fp32_lm_head,
    )
    model.requires_grad_(False)
    params = SamplingParams(**rep["sampling"]).validate()
    # The engine as the run configured it, but sized for this replay (on the CPU no graphs are captured anyway).
    engine = RolloutEngine(model, cfg.engine, tokenizer=tok)
    temperature = params.temperature if params.temperature > 0 else 1.0

    # 1. Re-generate each request once, with enough samples to reach every recorded sample index.
    by_request: dict[int, list[RecordedSequence]] = {}
    for s in recorded:
        by_request.setdefault(s.request_id, []).append(s)
    regenerated: dict[tuple[int, int], tuple[list[int], torch.Tensor]] = {}
    for rid, seqs in by_request.items():
        prompts = {tuple(s.prompt_ids) for s in seqs}
        if len(prompts) != 1:
            raise ValueError(
                f"{d}/report.json: request {rid} is recorded with {len(prompts)} different prompts"
            )
        n = max(params.n, 1 + max(s.sample_index for s in seqs))
        out = engine.generate([seqs[0].prompt_ids], dataclasses.replace(params, n=n), request_ids=[rid])[0]
        if out.error:
            raise ValueError(f"the engine refused request {rid} of {d}: {out.error}")
        for s in seqs:
            smp = out.samples[s.sample_index]
            regenerated[(rid, s.sample_index)] = (smp.token_ids, smp.rollout_logprobs.float().cpu())

    # 2. The trainer's path, on the recorded tokens and on the engine's re-sampled tokens.
    budget = cfg.train.max_tokens_per_microbatch
    trainer_recorded = completion_logprobs(
        model,
        [s.prompt_ids + s.completion_ids for s in recorded],
        [len(s.prompt_ids) for s in recorded],
        temperature,
        budget,
    )
    resampled = [regenerated[(s.request_id, s.sample_index)][0] for s in recorded]
    scorable = [i for i, toks in enumerate(resampled) if toks]
    trainer_resampled: list[torch.Tensor] = [torch.empty(0)] * len(recorded)
    if scorable:
        lps = completion_logprobs(
            model,
            [recorded[i].prompt_ids + resampled[i] for i in scorable],
            [len(recorded[i].prompt_ids) for i in scorable],
            temperature,
            budget,
        )
        for i, lp in zip(scorable, lps):
            trainer_resampled[i] = lp

    # 3. Compare.
    results = []
    for i, s in enumerate(recorded):
        toks, engine_lp = regenerated[(s.request_id, s.sample_index)]
        r = SequenceReplay(
            request_id=s.request_id,
            sample_index=s.sample_index,
            num_tokens=len(s.completion_ids),
            recorded_first=_first_diff(s.rollout_logprobs, s.trainer_logprobs),
            token_first=_first_diff(torch.tensor(toks), torch.tensor(s.completion_ids)),
            recompute_first=_first_diff(engine_lp, trainer_resampled[i]),
            rollout_first=None,
            trainer_first=_first_diff(s.trainer_logprobs, trainer_recorded[i]),
        )
        # The recomputed engine logprobs are of the recorded tokens up to the first re-sampled difference.
        common = len(s.completion_ids) if r.token_first is None else r.token_first
        r.rollout_first = _first_diff(s.rollout_logprobs[:common], engine_lp[:common])
        _describe(r, s, toks, engine_lp, trainer_resampled[i], trainer_recorded[i])
        if probe and (r.recompute_first is not None or r.recorded_first is not None):
            from exactrl.train.layer_probe import probe_layers

            p = probe_layers(model, s.prompt_ids, s.completion_ids, cfg.engine.max_model_len)
            r.layer, r.layer_note = p.layer, p.describe()
            r.experts = asdict(p.experts) if p.experts is not None else None
            r.lines.append(f"  {r.layer_note}")
            if s.first_differing_layer is not None and s.first_differing_layer != p.layer:
                r.lines.append(f"  (the run's probe found layer {s.first_differing_layer})")
        results.append(r)
    return ReplayResult(
        report_dir=str(d),
        step=int(rep["step"]),
        device=str(model.device),
        dtype=str(model.dtype).replace("torch.", ""),
        mode="exact" if exact else "fast",
        sequences=results,
    )


def _describe(
    r: SequenceReplay,
    s: RecordedSequence,
    toks: list[int],
    engine_lp: torch.Tensor,
    trainer_on_engine_tokens: torch.Tensor,
    trainer_on_recorded: torch.Tensor,
) -> None:
    """The human-readable lines of one sequence's replay (r.lines)."""
    L = r.lines
    name = f"request {s.request_id} sample {s.sample_index} ({r.num_tokens} tokens)"
    if r.recorded_first is None:
        L.append(f"{name}: recorded rollout and trainer logprobs are bitwise equal")
    else:
        p = r.recorded_first
        L.append(
            f"{name}: recorded mismatch at position {p} (token id {s.completion_ids[p]}): rollout "
            f"{_hex(s.rollout_logprobs, p)} vs trainer {_hex(s.trainer_logprobs, p)}"
        )
    if r.token_first is None:
        L.append("  engine re-sampled the same tokens: yes")
    else:
        q = r.token_first
        got = toks[q] if q < len(toks) else "end of completion"
        want = s.completion_ids[q] if q < len(s.completion_ids) else "end of completion"
        L.append(
            f"  engine re-sampled the same tokens: NO, from position {q} (recorded {want}, re-sampled {got}); "
            "sampling does not replay"
        )
    if r.recompute_first is None:
        L.append("  recomputed: engine and trainer logprobs bitwise equal")
    else:
        p = r.recompute_first
        tok = toks[p] if p < len(toks) else None
        L.append(
            f"  recomputed: DIVERGE at position {p} (token id {tok}): engine {_hex(engine_lp, p)} vs trainer "
            f"{_hex(trainer_on_engine_tokens, p)}"
        )
    if r.rollout_first is None:
        L.append("  recorded rollout logprobs reproduce: yes")
    else:
        p = r.rollout_first
        L.append(
            f"  recorded rollout logprob does not reproduce at position {p} (token id {s.completion_ids[p]}): "
            f"recorded {_hex(s.rollout_logprobs, p)}, engine now {_hex(engine_lp, p)}"
        )
    if r.trainer_first is None:
        L.append("  recorded trainer logprobs reproduce: yes")
    else:
        p = r.trainer_first
        L.append(
            f"  recorded trainer logprob does not reproduce at position {p} (token id {s.completion_ids[p]}): "
            f"recorded {_hex(s.trainer_logprobs, p)}, trainer now {_hex(trainer_on_recorded, p)}"
        )
