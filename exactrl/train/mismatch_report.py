"""The mismatch report: what a run leaves behind when a rollout logprob and the trainer's differ.

`<output_dir>/mismatch-<step>/` holds everything `exactrl parity --replay` needs to recompute both sides:

    report.json   the step, the config, the sampling parameters (seed, temperature, top-k/p, stop ids) and, per
                  offending sequence, its request id and sample index (the sampling noise key), prompt and
                  completion token ids, both logprob vectors (hex floats: the exact bits; and decimals to read),
                  the first differing position and token, and the first differing layer when the probe ran
    config.toml   the run's config (loads with `exactrl.config.load_config`)
    policy/       the weights at the sampling step, as an HF checkpoint with the tokenizer

At an abort no optimizer step has touched the batch, so the model's current weights are the sampling weights.
Floats are written with `float.hex`: a decimal round trip of an fp32 value is exact too, but only hex shows a
reader the one-ulp differences the report is about.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exactrl.config import RunConfig, config_to_dict, save_config
from exactrl.engine.sampler import SamplingParams
from exactrl.model.qwen import CausalLM

REPORT_FORMAT = "exactrl-mismatch-report/1"
# A report keeps the sequences the layer probe runs on bounded: each costs an engine prefill and a trainer
# forward of one sequence, and the first few say where the paths part as well as all of them would.
MAX_PROBED_SEQUENCES = 4


@dataclass
class MismatchSequence:
    """One completion whose rollout logprobs and trainer logprobs differ.

    request_id, sample_index: with the sampling seed, the key of the sampling noise (the engine re-draws the same
    tokens from them); prompt_ids, completion_ids: token ids; rollout_logprobs, trainer_logprobs:
    [len(completion_ids)] fp32, what the engine recorded and what the trainer computed at the sampling weights;
    rank: the trainer rank that found it (None on one process)."""

    request_id: int
    sample_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    rollout_logprobs: torch.Tensor
    trainer_logprobs: torch.Tensor
    rank: int | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        for name in ("rollout_logprobs", "trainer_logprobs"):
            t = getattr(self, name)
            if t.dim() != 1 or t.numel() != n:
                raise ValueError(
                    f"MismatchSequence(request {self.request_id}, sample {self.sample_index}).{name} has shape "
                    f"{tuple(t.shape)}; expected [{n}] (one per completion token)"
                )

    def differing_positions(self) -> list[int]:
        """Completion positions whose two logprobs are not bitwise equal (a NaN on either side counts)."""
        r = self.rollout_logprobs.detach().float().cpu()
        t = self.trainer_logprobs.detach().float().cpu()
        return (r != t).nonzero()[:, 0].tolist()

    def first_difference(self) -> int | None:
        d = self.differing_positions()
        return d[0] if d else None


def hex_floats(t: torch.Tensor) -> list[str]:
    """fp32 values as `float.hex` strings (exact: every fp32 value is a Python float)."""
    return [float(x).hex() for x in t.detach().float().cpu().tolist()]


def floats_from_hex(values: list[str], where: str) -> torch.Tensor:
    """The inverse of hex_floats: [N] fp32. A value that is not a hex float raises naming `where` and its index."""
    out = []
    for i, v in enumerate(values):
        try:
            out.append(float.fromhex(v))
        except (TypeError, ValueError):
            raise ValueError(f"{where}[{i}] = {v!r} is not a hex float (float.hex)") from None
    return torch.tensor(out, dtype=torch.float32)


def _show(x: float) -> str:
    """A logprob as '<hex> (<decimal>)': the hex for the bits, the decimal for a reader."""
    return f"{float(x).hex()} ({x!r})" if math.isfinite(x) else repr(x)


def format_mismatch_error(step: int, seq: MismatchSequence, layer: int | None = None) -> str:
    """One message naming the step, the request and sample, the first differing token (position and id) and
    both logprobs as hex floats (and decimals); with `layer`, the first decoder layer whose output differs."""
    pos = seq.first_difference()
    head = f"step {step}: request {seq.request_id} sample {seq.sample_index}"
    if seq.rank is not None:
        head += f" (rank {seq.rank})"
    if pos is None:
        return f"{head}: rollout and trainer logprobs are bitwise equal"
    r = float(seq.rollout_logprobs[pos])
    t = float(seq.trainer_logprobs[pos])
    n = len(seq.differing_positions())
    msg = (
        f"{head}: completion token {pos} (id {seq.completion_ids[pos]}): rollout logprob {_show(r)} != "
        f"trainer logprob {_show(t)} ({n} of {len(seq.completion_ids)} tokens of this sequence differ)"
    )
    if layer is not None:
        msg += f"; first differing layer: {layer}"
    return msg


def sampling_record(params: SamplingParams | dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters as report.json keeps them; refuses keys SamplingParams does not have (a typo
    caught when the report is written, not when someone replays it)."""
    d = dataclasses.asdict(params) if isinstance(params, SamplingParams) else dict(params)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"sampling parameters {unknown} are not SamplingParams fields ({sorted(known)})")
    SamplingParams(**d).validate()
    return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in d.items()}


def _sequence_record(seq: MismatchSequence) -> dict[str, Any]:
    pos = seq.first_difference()
    return {
        "request_id": int(seq.request_id),
        "sample_index": int(seq.sample_index),
        "rank": seq.rank,
        "prompt_ids": [int(x) for x in seq.prompt_ids],
        "completion_ids": [int(x) for x in seq.completion_ids],
        "rollout_logprobs_hex": hex_floats(seq.rollout_logprobs),
        "trainer_logprobs_hex": hex_floats(seq.trainer_logprobs),
        "rollout_logprobs": seq.rollout_logprobs.detach().float().cpu().tolist(),
        "trainer_logprobs": seq.trainer_logprobs.detach().float().cpu().tolist(),
        "num_differing": len(seq.differing_positions()),
        "first_differing_position": pos,
        "first_differing_token_id": None if pos is None else int(seq.completion_ids[pos]),
        "first_differing_layer": None,
        "layer_probe": None,
    }


def write_mismatch_report(
    out_dir: Path,
    step: int,
    *,
    cfg: RunConfig,
    model: CausalLM,
    tokenizer,
    sequences: list[MismatchSequence],
    sampling: dict[str, Any] | SamplingParams,
    probe_layers: bool = True,
) -> Path:
    """Write `<out_dir>/mismatch-<step:06d>/` (report.json, config.toml, policy/) and return its path.

    `model` must hold the weights the sequences were sampled with (at an abort, before any optimizer step on
    the batch). With probe_layers, the first few sequences also get `first_differing_layer`: an engine prefill
    and a trainer forward of the sequence are compared layer by layer (exactrl.train.layer_probe)."""
    if not sequences:
        raise ValueError("write_mismatch_report: no sequences to report")
    final = Path(out_dir) / f"mismatch-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    records = [_sequence_record(s) for s in sequences]
    if probe_layers:
        from exactrl.train.layer_probe import probe_layers as probe

        for rec, seq in list(zip(records, sequences))[:MAX_PROBED_SEQUENCES]:
            p = probe(model, seq.prompt_ids, seq.completion_ids, cfg.engine.max_model_len)
            rec["first_differing_layer"], rec["layer_probe"] = p.layer, p.describe()
    report = {
        "format": REPORT_FORMAT,
        "step": int(step),
        "model": {
            "dtype": str(model.dtype).replace("torch.", ""),
            "device": str(model.device),
            "exact": bool(model.ops.exact),
            "ops": model.ops.name,
        },
        "sampling": sampling_record(sampling),
        "policy": "policy",
        "config": config_to_dict(cfg),
        "sequences": records,
    }
    (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    save_config(cfg, tmp / "config.toml")
    from exactrl.model.hf import save_model

    save_model(model, tmp / "policy", tokenizer=tokenizer)
    # Complete or absent: a report is renamed into place only once every file is written.
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


@dataclass
class RecordedSequence(MismatchSequence):
    """A MismatchSequence read back from report.json, with what the run recorded about it."""

    first_differing_layer: int | None = None


def read_mismatch_report(report_dir: str | Path) -> tuple[dict[str, Any], list[RecordedSequence]]:
    """(report.json as a dict, its sequences with exact fp32 logprobs from the hex values). Errors name the file
    and the key that is missing or malformed."""
    d = Path(report_dir)
    path = d / "report.json"
    if not path.is_file():
        raise FileNotFoundError(f"{d} is not a mismatch report: no report.json in it")
    try:
        rep = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
    if rep.get("format") != REPORT_FORMAT:
        raise ValueError(f"{path}: format is {rep.get('format')!r}, expected {REPORT_FORMAT!r}")
    for key in ("step", "sampling", "sequences"):
        if key not in rep:
            raise ValueError(f"{path}: key {key!r} is missing")
    seqs = []
    for i, s in enumerate(rep["sequences"]):
        where = f"{path}: sequences[{i}]"
        try:
            seqs.append(
                RecordedSequence(
                    request_id=int(s["request_id"]),
                    sample_index=int(s["sample_index"]),
                    prompt_ids=[int(x) for x in s["prompt_ids"]],
                    completion_ids=[int(x) for x in s["completion_ids"]],
                    rollout_logprobs=floats_from_hex(
                        s["rollout_logprobs_hex"], f"{where}.rollout_logprobs_hex"
                    ),
                    trainer_logprobs=floats_from_hex(
                        s["trainer_logprobs_hex"], f"{where}.trainer_logprobs_hex"
                    ),
                    rank=s.get("rank"),
                    first_differing_layer=s.get("first_differing_layer"),
                )
            )
        except KeyError as e:
            raise ValueError(f"{where}: key {e.args[0]!r} is missing") from None
    return rep, seqs


def abort_message(report_dir: str | Path, total_sequences: int | None = None) -> str:
    """The error a run stops with after writing a report: the first offending sequence (step, request, sample,
    position, token id, both logprobs in hex, the first differing layer when the probe found one), how many
    sequences differ, where the report is and the command that replays it."""
    rep, seqs = read_mismatch_report(report_dir)
    first = rep["sequences"][0]
    msg = format_mismatch_error(rep["step"], seqs[0], layer=first.get("first_differing_layer"))
    n = total_sequences if total_sequences is not None else len(seqs)
    return (
        f"rollout/trainer logprob mismatch: {msg}. {n} sequence(s) differ; no optimizer step was taken on this "
        f"batch. Report: {report_dir} (replay: exactrl parity --replay {report_dir})"
    )
