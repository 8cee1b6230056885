"""What the multi-rank tests launch under `python -m torch.distributed.run`: several jobs in one launch (starting
torch and the process group costs seconds a launch on a 2-core machine).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/distributed/_driver.py SPEC.json

SPEC.json: {"jobs": [job, ...]}, run in order on every rank. A job is one of
  {"kind": "cli", "argv": [...]}                   `exactrl <argv>` through exactrl.cli.main (the real entry point)
  {"kind": "cli", "argv": [...], "fail_rank": R}   the same, but rank R raises in its first training update (the
                                                   other ranks are inside a collective by then): a rank failing
  {"kind": "cli", "argv": [...], "skip_push": true} the same, but a disaggregated run's trainers send the
                                                   generators their first weights only (a negative control)
  {"kind": "cli", "argv": [...], "stop_at": S}      the same, stopped after step S as by a signal (a checkpoint at S,
                                                   exit code 130); the next job can resume it
  {"kind": "cli", "argv": [...], "plant_cut": true} the same, but the first partial-rollout cut of a process that
                                                   cuts a sample mid-completion records that sample's first logprob
                                                   one ulp off (a negative control for the guard)
  {"kind": "cli", "argv": [...], "plant_generated": N, "guard_log": "FILE.json"}
                                                   the same, but a disaggregated generator's N-th generate answer to
                                                   trainer 0 records its first sample's first logprob one ulp off
                                                   (the fault the guard must refuse before any update uses it); and
                                                   each trainer rank writes FILE-rank<r>.json: for every one-step-off
                                                   step, whether the guard refused it (skipped, or raised) and
                                                   whether the rank's weights were equal after the step to before it
  {"kind": "weights", "out": "FILE.json", "skip_sync": bool, "preset": "tiny"}
                                                   trains a bf16 model of the preset (default tiny) a step under FSDP2
                                                   and compares, for every parameter, the engine replica's tensor with
                                                   the bits the trainer's forward computes with (captured inside that
                                                   forward), on every rank; skip_sync: the negative control (no weight
                                                   sync). Also the sharded model's state_dict() (HF names, per-expert
                                                   for a mixture of experts) against the replica's
  {"kind": "cli", "argv": [...], "plant": "row_parallel" | "partial_combine" | "adapters_off"}
                                                   the same, but a shared engine's o_proj / down_proj sum partial
                                                   products over K slices (Megatron's row-parallel arithmetic): the
                                                   negative control of engine.tensor_parallel in exactrl train;
                                                   or its experts' combine split over the ranks; or its o_proj /
                                                   down_proj run without their LoRA adapters
  {"kind": "cli", "argv": [...], "cwd_rank": {"R": DIR}, "expect_code": C}
                                                   the same, rank R working in DIR (a relative run.output_dir
                                                   is then another folder there: a node that does not share
                                                   the run directory); exit code C is this job's expected end
  {"kind": "cli", "argv": [...], "generator_memory": "FILE.json"}
                                                   the same, and each disaggregated generator rank writes
                                                   FILE-rank<r>.json once it is stopped: the bytes its model's
                                                   parameters allocate (distinct storages), those of its weights
                                                   that are not fp8 projections, its fp8 projections' model-dtype
                                                   bytes, its fp8 copies, and how many fp8 projections a
                                                   model-dtype sync quantized on arrival
  {"kind": "crashed", "src": DIR, "dst": DIR, "step": S}
                                                   rank 0 copies run DIR as a crash after step S's checkpoint leaves it
  {"kind": "per_rank", "out": "FILE.json"}         `per_rank_metric` of a value that differs on every rank
                                                   (10 + 1.5 * rank), written by rank 0
A job that fails exits the process with a non-zero status (torchrun then stops the other ranks).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch


def cli_job(job: dict) -> None:
    import exactrl.cli
    from exactrl.cli import main

    # The jobs of one launch share the process group: a command leaves it in place for the next one (destroying
    # and starting the default group again within one torchrun launch hangs).
    exactrl.cli._end_process_group = lambda: None

    fail_rank = job.get("fail_rank")
    if fail_rank is not None and int(os.environ["RANK"]) == fail_rank:
        from exactrl.train import stages

        def failing_update(self, step, rollouts):
            raise RuntimeError(f"planted failure on rank {fail_rank} at step {step + 1}")

        stages.RunStages.update = failing_update
    if job.get("skip_push"):  # the disaggregated layout's negative control: the generators keep stale weights
        from exactrl.train import disagg

        real_push = disagg.RemoteEngine.push

        def push_first_only(self, named):
            if getattr(self, "_pushed", False):
                return {}
            self._pushed = True
            return real_push(self, named)

        disagg.RemoteEngine.push = push_first_only
    undo = []
    if (
        job.get("plant") == "row_parallel"
    ):  # a shared engine's negative control: o_proj / down_proj sum partials
        from exactrl.distributed import tensor_parallel

        def row_parallel(self, ops, x):
            # Megatron's row-parallel arithmetic: each rank's K slice (its features) times the weight's matching
            # columns, rounded to the model dtype, the partials summed in rank order (an all-reduce of T).
            x = self.tp.gather_last(x)
            k = x.shape[1] // self.tp.size
            parts = [
                ops.linear(
                    x[:, r * k : (r + 1) * k].contiguous(), self.weight[:, r * k : (r + 1) * k].contiguous()
                )
                for r in range(self.tp.size)
            ]
            y = parts[0]
            for p in parts[1:]:
                y = y + p
            if self.bias is not None:
                y = y + self.bias
            return self.tp.gather_last(y)

        real_row = tensor_parallel.GatheredLinear.forward
        tensor_parallel.GatheredLinear.forward = row_parallel
        undo.append(lambda: setattr(tensor_parallel.GatheredLinear, "forward", real_row))
    if job.get("plant") == "adapters_off":  # a shared engine whose gathered layers drop their adapters
        from exactrl.distributed import tensor_parallel

        real_gathered = tensor_parallel.GatheredLinear.forward

        def without_adapter(self, ops, x):
            x = self.tp.gather_last(x)
            return self.tp.gather_last(ops.linear(x, self.weight, self.bias))

        tensor_parallel.GatheredLinear.forward = without_adapter
        undo.append(lambda: setattr(tensor_parallel.GatheredLinear, "forward", real_gathered))
    if (
        job.get("plant") == "partial_combine"
    ):  # expert parallel's negative control: a combine split over ranks
        from _tp_driver import PartialCombineExperts  # this script's folder is first on sys.path

        from exactrl.distributed import expert_parallel

        real_combine = expert_parallel.ExpertParallelExperts.forward
        expert_parallel.ExpertParallelExperts.forward = PartialCombineExperts.forward
        undo.append(lambda: setattr(expert_parallel.ExpertParallelExperts, "forward", real_combine))
    if job.get("stop_at") is not None:  # a signal after step S, on every rank at once
        from exactrl.train import loop

        real_stop, stop_at = loop.RLRun.stop_requested, job["stop_at"]
        loop.RLRun.stop_requested = lambda self: self.step == stop_at or real_stop(self)
        undo.append(lambda: setattr(loop.RLRun, "stop_requested", real_stop))
    if job.get("plant_cut"):
        undo.append(_plant_first_cut())
    private = job.get("cwd_rank", {}).get(os.environ["RANK"])
    if private is not None:
        here = os.getcwd()
        Path(private).mkdir(parents=True, exist_ok=True)
        os.chdir(private)
        undo.append(lambda: os.chdir(here))
    if job.get("plant_generated"):
        undo.append(_plant_generated(int(job["plant_generated"])))
    if job.get("guard_log"):
        undo.append(_log_refused_steps(job["guard_log"]))
    if job.get("generator_memory"):
        undo.append(_log_generator_memory(job["generator_memory"]))
    try:
        code = main(job["argv"])
    finally:
        for u in undo:
            u()
    if code and not (code == 130 and job.get("stop_at") is not None) and code != job.get("expect_code"):
        sys.exit(code)
    if job.get("expect_code") not in (None, code):
        sys.exit(f"expected exit code {job['expect_code']}, got {code}")


def _plant_first_cut():
    """The first `PartialGeneration.cut` of this process that cuts a sample mid-completion nudges that sample's first
    logprob one ulp toward 0 (no earlier cut left a started sample, so every token of it is this generation's).
    Returns the undo."""
    import exactrl.engine.partial as engine_partial

    original = engine_partial.PartialGeneration.cut
    done: list = []

    def cut(self):
        out = original(self)
        started = [s for s in out if not s.finished and s.completion_ids]
        if started and not done:
            s = started[0]
            s.rollout_logprobs[0] = float(
                torch.nextafter(torch.tensor(s.rollout_logprobs[0]), torch.tensor(0.0))
            )
            done.append((s.request_id, s.sample_index))
        return out

    engine_partial.PartialGeneration.cut = cut
    return lambda: setattr(engine_partial.PartialGeneration, "cut", original)


def _plant_generated(n: int):
    """A disaggregated generator's n-th generate answer to trainer 0: its first sample's first logprob one ulp
    toward 0, as a fault between the generator's engine and the trainer would. Returns the undo."""
    from exactrl.train import disagg

    original = disagg.GeneratorLoop._answer
    seen = [0]

    def answer(self, obj, trainer):
        if trainer == 0 and isinstance(obj, list) and obj and hasattr(obj[0], "samples"):
            seen[0] += 1
            if seen[0] == n:
                lp = obj[0].samples[0].rollout_logprobs
                lp[0] = torch.nextafter(lp[0], torch.tensor(0.0))
        return original(self, obj, trainer)

    disagg.GeneratorLoop._answer = answer
    return lambda: setattr(disagg.GeneratorLoop, "_answer", original)


def _log_generator_memory(path: str):
    """Each generator rank, once its trainers stop it, writes what its model's parameters allocate (see the module
    docstring). Returns the undo."""
    from exactrl.model.precision import fp8_projections
    from exactrl.train import disagg

    original_serve, original_receive = disagg.GeneratorLoop.serve, disagg.fp8_receive_weight
    received = [0]

    def receive(*args):
        got = original_receive(*args)
        received[0] += bool(got)
        return got

    def serve(self):
        original_serve(self)
        model = self.engine.model
        fp8 = (
            {id(getattr(m, a)) for m, a, _ in fp8_projections(model)}
            if hasattr(model.ops, "entry_of")
            else set()
        )
        params = list(model.parameters())
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
        row = {
            "param_storage": sum(storages.values()),
            "other_weights": sum(p.numel() * p.element_size() for p in params if id(p) not in fp8),
            "fp8_weights": sum(p.numel() * p.element_size() for p in params if id(p) in fp8),
            "fp8_copies": len(fp8),
            "received_as_weight": received[0],
        }
        stem = path[: -len(".json")] if path.endswith(".json") else path
        with open(f"{stem}-rank{os.environ['RANK']}.json", "w") as f:
            json.dump(row, f)

    disagg.GeneratorLoop.serve, disagg.fp8_receive_weight = serve, receive

    def undo():
        disagg.GeneratorLoop.serve, disagg.fp8_receive_weight = original_serve, original_receive

    return undo


def _log_refused_steps(path: str):
    """Each trainer rank writes, for every one-step-off step, whether the guard refused the batch (the step skipped,
    or MismatchError) and whether the rank's weights (its FSDP2 shards) after the step equal those before it.
    Returns the undo."""
    from exactrl.train.drivers.offpolicy import OneStepOffDriver
    from exactrl.train.trainer import MismatchError

    original = OneStepOffDriver.step
    rows: list[dict] = []

    def local(model) -> list[torch.Tensor]:
        return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]

    def write() -> None:
        stem = path[: -len(".json")] if path.endswith(".json") else path
        with open(f"{stem}-rank{os.environ['RANK']}.json", "w") as f:
            json.dump(rows, f)

    def step(self):
        step_no = self.ctx.state.step + 1
        before = local(self.ctx.trainer.model)
        try:
            m = original(self)
        except MismatchError:
            after = local(self.ctx.trainer.model)
            rows.append(
                {"step": step_no, "refused": True, "raised": True, "unchanged": _equal(before, after)}
            )
            write()
            raise
        after = local(self.ctx.trainer.model)
        refused = bool(m.get("mismatch/step_skipped", 0.0))
        rows.append(
            {"step": step_no, "refused": refused, "raised": False, "unchanged": _equal(before, after)}
        )
        write()
        return m

    OneStepOffDriver.step = step
    return lambda: setattr(OneStepOffDriver, "step", original)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _forward_weights(model: torch.nn.Module, run_forward) -> dict[str, torch.Tensor]:
    """The tensors each module's forward sees for its own parameters (under FSDP2: the all-gathered parameters
    in the compute dtype, after FSDP's pre-forward hook), by full parameter name. A module's hook skips the
    parameters still sharded (DTensor): those of the nested layers, which their own forward unshards."""
    from torch.distributed.tensor import DTensor

    seen: dict[str, torch.Tensor] = {}
    handles = []
    for prefix, mod in model.named_modules():
        if not hasattr(mod, "unshard"):  # FSDP2 modules: each decoder layer and the root
            continue

        def hook(m, args, kwargs, prefix=prefix):
            for name, p in m.named_parameters():
                if not isinstance(p, DTensor):
                    seen.setdefault(f"{prefix}.{name}" if prefix else name, p.detach().clone())

        handles.append(mod.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        run_forward()
    finally:
        for h in handles:
            h.remove()
    return seen


def weights_job(job: dict) -> None:
    from torch.distributed.tensor import DTensor

    from exactrl.distributed.env import init_from_env
    from exactrl.distributed.parallelize import Parallelism
    from exactrl.model.loading import load_policy
    from exactrl.ops import set_exact_environment
    from exactrl.train.optim import MasterAdamW
    from exactrl.train.packing import PackedBatch, response_logprobs
    from exactrl.train.trainer import PolicyTrainer, Rollout, TrainerSettings

    set_exact_environment(True)
    ctx = init_from_env("cpu")
    model, _ = load_policy(preset_name=job.get("preset", "tiny"), device="cpu", dtype="bfloat16", seed=0)
    par = Parallelism(ctx)
    replica = par.engine_model(model)
    par.parallelize(model)
    par.bind(model, replica)
    opt = MasterAdamW(model, lr=1e-2, dist=ctx)
    # Synthetic rollouts (no engine logprobs): the guard would refuse them; "warn" keeps the update.
    settings = TrainerSettings(exact=True, on_mismatch="warn")
    trainer = PolicyTrainer(model, settings, opt, dist=ctx)
    g = torch.Generator().manual_seed(1 + ctx.rank)  # each rank trains on rollouts of its own
    rollouts = [
        Rollout(
            torch.randint(0, 200, (5,), generator=g).tolist(),
            torch.randint(0, 200, (4 + k,), generator=g).tolist(),
            torch.zeros(4 + k),
            advantage=1.0 if k % 2 else -1.0,
        )
        for k in range(4)
    ]
    trainer.step(rollouts)
    if not job.get("skip_sync"):
        par.sync_weights()
    seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
    pb = PackedBatch.build(seqs, [len(r.prompt_ids) for r in rollouts], model.device)
    with torch.no_grad():
        used = _forward_weights(model, lambda: response_logprobs(model, pb, 1.0))
    engine = dict(replica.named_parameters())
    report = {"rank": ctx.rank, "params": len(engine), "captured": len(used), "differ": [], "not_plain": []}
    report["expert_stacks"] = [n for n in engine if n.endswith(("experts.gate_up", "experts.down"))]
    for name, e in engine.items():
        t = used.get(name)
        if t is None or isinstance(t, DTensor) or t.dtype != e.dtype:
            report["not_plain"].append(name)
        elif not torch.equal(t, e):
            report["differ"].append(name)
    # The sharded model's state dict in HF names (every rank calls it: sharded stacks are gathered): full plain
    # tensors whose model-dtype cast is the replica's, after the sync (the masters are fp32).
    sharded_sd = model.state_dict()
    replica_sd = replica.state_dict()
    experts = {k: v for k, v in sharded_sd.items() if ".experts." in k}
    report["state_dict_keys"] = sorted(sharded_sd) == sorted(replica_sd)
    report["state_dict_experts"] = len(experts)
    report["state_dict_dtensor_experts"] = [k for k, v in experts.items() if isinstance(v, DTensor)]
    report["state_dict_differ"] = [
        k
        for k, v in experts.items()
        if not isinstance(v, DTensor) and not torch.equal(v.to(replica_sd[k].dtype), replica_sd[k])
    ]
    # Every rank's report, written by rank 0.
    reports = ctx.all_gather_object(report)
    if ctx.is_main:
        with open(job["out"], "w") as f:
            json.dump(reports, f)


def crashed_job(job: dict) -> None:
    """Rank 0 copies run `src` to `dst` as a crash right after step `step`'s checkpoint leaves it (`_runs.crashed_after`),
    the others wait: a resume in the same launch."""
    import torch.distributed as dist

    from tests.distributed._runs import crashed_after

    if dist.get_rank() == 0:
        crashed_after(Path(job["src"]), Path(job["dst"]), job["step"])
    dist.barrier()


def per_rank_job(job: dict) -> None:
    from exactrl.distributed.env import init_from_env, per_rank_metric

    ctx = init_from_env("cpu")
    m = per_rank_metric(ctx, "perf/gpu_memory_peak_gb", 10.0 + 1.5 * ctx.rank)
    everyone = ctx.all_gather_object(m)  # every rank must hold the same metrics
    if ctx.is_main:
        with open(job["out"], "w") as f:
            json.dump(everyone, f)


def main() -> None:
    import exactrl.cli

    # The jobs share the process group (cli_job keeps each command from leaving it); the launch leaves it once,
    # at the end, the way a command does (a rank exiting with the group alive can die of SIGABRT after its work).
    leave = exactrl.cli._end_process_group
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    for job in spec["jobs"]:
        jobs = {"cli": cli_job, "weights": weights_job, "per_rank": per_rank_job, "crashed": crashed_job}
        jobs[job["kind"]](job)
    leave()


if __name__ == "__main__":
    main()
