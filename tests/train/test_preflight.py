"""What a new user met in `exactrl plan` and the config checks (issue 43, item 5): plan refuses what train refuses,
plans for the machine it is told about (not the one it runs on), offers the settings that fit, says what a CPU plan
is; keys that do nothing in the chosen mode are named; a key in the wrong section points to the right one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exactrl.cli import main
from exactrl.config import ConfigError, apply_overrides, config_from_dict, load_config
from exactrl.train import memory
from exactrl.train.memory import GiB
from exactrl.train.memory_fit import make_plan

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = str(ROOT / "configs" / "quickstart.toml")
BIG_8B = [
    "--set",
    "model.preset=qwen3-8b",
    "--set",
    "model.dtype=bfloat16",
    "--set",
    "train.offload=optimizer",
]


def plan_cli(capsys, *args: str) -> tuple[int, list[str], str]:
    rc = main(["plan", QUICKSTART, *args, "--json"])
    cap = capsys.readouterr()
    return rc, cap.out.splitlines(), cap.err


def test_plan_for_another_machine_does_not_check_this_hosts_memory(capsys, monkeypatch):
    """A laptop of 16 GiB plans an 8-GPU node: the host it runs on is not the node's, so without --host-memory
    the pinned state is not checked (and the line says how to check it); with --host-memory it is."""
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 16 * GiB)
    rc, out, _ = plan_cli(capsys, *BIG_8B, "--nproc", "8", "--gpu-memory", "80")
    assert rc == 0, out
    host = next(line for line in out if line.startswith("host memory per rank"))
    assert "not checked against a host's RAM (--host-memory GB checks it)" in host
    assert json.loads(out[-1])["memory_plan"]["host_memory_bytes"] is None
    rc, out, _ = plan_cli(capsys, *BIG_8B, "--nproc", "8", "--gpu-memory", "80", "--host-memory", "24")
    assert rc == 1 and "DOES NOT FIT" in "\n".join(out)


def test_a_host_refusal_on_this_machine_names_host_memory():
    cfg = load_config(QUICKSTART, BIG_8B[1::2] + ["run.device=cuda"])
    plan = make_plan(cfg, world_size=8, gpu_memory=80 * GiB, host_memory=24 * GiB)
    assert not plan.host_fits
    why = plan.refusal()
    assert "--host-memory GB" in why and "this machine's RAM" in why
    # The buffers are page-locked at their exact size (exactrl/train/pinned.py): the text says so, not the power
    # of two torch's pinned allocator would round to.
    assert "power of two" not in why and "exact size" in why
    given = make_plan(
        cfg, world_size=8, gpu_memory=80 * GiB, host_memory=24 * GiB, host_memory_from="--host-memory"
    )
    assert "this machine's RAM" not in given.refusal()


def test_suggestions_include_offload_off_when_the_host_cannot_pin():
    """qwen3-8b at --nproc 8 with offload on fits the GPUs but not a 24 GiB host: offload off fits (the device
    holds the moment shards), and is offered."""
    cfg = load_config(QUICKSTART, BIG_8B[1::2] + ["run.device=cuda"])
    plan = make_plan(cfg, world_size=8, gpu_memory=80 * GiB, host_memory=24 * GiB)
    assert any(s.startswith('train.offload="none" (peak') for s in plan.suggestions), plan.suggestions


def test_more_ranks_with_the_memory_settings_are_offered_before_a_smaller_model():
    """qwen3-30b-a3b at --nproc 2 fits nothing alone, LoRA included; at --nproc 8 with the optimizer state
    offloaded it fits (docs/memory.md): that is offered instead of "a smaller model"."""
    cfg = load_config(
        QUICKSTART,
        [
            "model.preset=qwen3-30b-a3b",
            "model.dtype=bfloat16",
            "run.device=cuda",
            "algorithm.rollouts_per_step=128",
            "engine.max_model_len=1024",
            "sampling.max_tokens=512",
            "train.fsdp_reduce=microbatch",
        ],
    )
    gpu, host = int(79.18 * GiB), 1000 * GiB
    plan = make_plan(cfg, world_size=2, gpu_memory=gpu, host_memory=host)
    assert not plan.fits
    assert plan.suggestions and plan.suggestions[-1].startswith('--nproc 8 with train.offload="optimizer"')
    assert "a smaller model" not in plan.refusal()
    eight = make_plan(
        apply_overrides(cfg, ["train.offload=optimizer"]), world_size=8, gpu_memory=gpu, host_memory=host
    )
    assert eight.fits


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--host-memory", "-1", "--host-memory must be a positive number"),
        ("--gpu-memory", "0.5", "--gpu-memory 0.5: the plan counts 1.00 GiB of CUDA context"),
        ("--host-memory", "4", "--host-memory 4: the plan counts 8.00 GiB left to the process"),
    ],
)
def test_memory_flags_are_checked_by_name(capsys, flag, value, said):
    rc, out, err = plan_cli(capsys, flag, value)
    assert rc == 2 and said in err and not out
    assert "-0." not in err


@pytest.mark.parametrize(
    "sets, said",
    [
        (["run.device=cuda", "model.preset=tiny-moe", "algorithm.overlap=tail"], "mixture-of-experts"),
        (["train.moe_aux_loss_coef=0.01"], "router losses need a mixture-of-experts model"),
        (
            ["env.name=guess", "algorithm.max_off_policy_steps=2", "algorithm.partial_rollouts=true"],
            "is single-turn for now",
        ),
    ],
)
def test_plan_refuses_what_train_refuses(capsys, sets, said):
    """Each of these passed `exactrl plan` and was refused by `exactrl train` once the model had loaded; both now
    run exactrl.train.preflight.check_run_config."""
    args = [x for s in sets for x in ("--set", s)]
    rc, out, err = plan_cli(capsys, *args)
    assert rc == 2 and said in err, err
    from exactrl.train.preflight import check_run_config

    with pytest.raises(ValueError, match=said):
        check_run_config(load_config(QUICKSTART, sets), 1, distributed=False)


def test_a_cpu_config_is_planned_as_a_cpu_run(capsys):
    """run.device = "cpu" (the quickstart) without --gpu-memory: a CPU plan that says what it is (host memory per
    rank, no verdict, no CUDA terms); --gpu-memory plans it on a CUDA device and says so."""
    rc, out, _ = plan_cli(capsys)
    j = json.loads(out[-1])["memory_plan"]
    assert rc == 0 and j["device"] == "cpu" and j["available_bytes"] is None
    assert "decode_graph_pool" not in j["phases"]["generation"]
    assert any(line.startswith("run.device = 'cpu': each term is host memory of one rank") for line in out)
    rc, out, _ = plan_cli(capsys, "--gpu-memory", "80")
    j = json.loads(out[-1])["memory_plan"]
    assert rc == 0 and j["device"] == "cuda" and "decode_graph_pool" in j["phases"]["generation"]
    assert out[0].startswith('run.device = "cpu" in the config: planned for a CUDA device')


def test_keys_that_do_nothing_in_the_chosen_mode_are_named():
    from exactrl.train.preflight import inert_keys

    base = config_from_dict({"model": {"preset": "tiny"}})
    assert inert_keys(base, "cpu") == []
    cfg = apply_overrides(
        config_from_dict({"model": {"preset": "tiny"}}),
        ["algorithm.partial_oversample=0.5", "algorithm.off_policy_is_cap=3.0", "train.offload=optimizer"],
    )
    notes = inert_keys(cfg, "cpu")
    assert len(notes) == 3
    assert notes[0].startswith("algorithm.partial_oversample = 0.5 does nothing")
    assert notes[1].startswith("algorithm.off_policy_is_cap = 3.0 does nothing")
    assert notes[2].startswith("train.offload = \"optimizer\" saves nothing on run.device = 'cpu'")
    # In the modes where they act, nothing is said.
    on = apply_overrides(
        cfg, ["algorithm.partial_rollouts=true", "algorithm.max_off_policy_steps=2", "run.exact=true"]
    )
    assert inert_keys(on, "cuda") == []


def test_train_warns_of_inert_keys_before_it_starts(capsys, tmp_path, monkeypatch):
    """`exactrl train` prints the warning first (then fails here on purpose: a config error later in the start)."""
    import exactrl.train.loop as loop

    def stop(*a, **k):
        raise ValueError("stopped after the warnings")

    monkeypatch.setattr(loop, "train", stop)
    rc = main(
        ["train", QUICKSTART, "--set", f"run.output_dir={tmp_path}", "--set", "algorithm.off_policy_is_cap=3"]
    )
    cap = capsys.readouterr()
    assert rc == 2 and "warning: algorithm.off_policy_is_cap = 3.0 does nothing" in cap.out


def test_overwrite_says_nothing_of_deleting_before_a_refused_config(capsys, tmp_path):
    """A config `train` refuses is refused before the run directory is looked at: the old run's files are not
    announced as deleted (and are not deleted)."""
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    rc = main(
        [
            "train",
            QUICKSTART,
            "--overwrite",
            "--set",
            f"run.output_dir={tmp_path}",
            "--set",
            "train.moe_aux_loss_coef=0.01",
        ]
    )
    cap = capsys.readouterr()
    assert rc == 2 and "router losses need" in cap.err
    assert "--overwrite" not in cap.out and (tmp_path / "metrics.jsonl").is_file()


def test_a_resume_into_another_mode_says_what_it_drops(tmp_path):
    from exactrl.train.offpolicy import PENDING_FILE
    from exactrl.train.partial import PARTIAL_FILE
    from exactrl.train.preflight import dropped_on_resume

    (tmp_path / PENDING_FILE).write_text("{}\n")
    (tmp_path / PARTIAL_FILE).write_text(json.dumps({"next_request_id": 9, "pool": [{}, {}]}) + "\n")
    notes = dropped_on_resume(tmp_path, off_policy=False, partial=False)
    assert len(notes) == 2
    assert "batch sampled ahead" in notes[0] and "dropped" in notes[0]
    assert notes[1].startswith("resume: the checkpoint holds 2 prompt group(s) in flight")
    assert dropped_on_resume(tmp_path, off_policy=True, partial=True) == []


def test_a_key_in_the_wrong_section_points_to_its_section():
    with pytest.raises(ConfigError, match=r"did you mean 'engine.release_memory'\?"):
        apply_overrides(config_from_dict({}), ["train.release_memory=true"])
    # A misspelt sibling is still found.
    with pytest.raises(ConfigError, match=r"did you mean 'train.check_memory'\?"):
        apply_overrides(config_from_dict({}), ["train.check_memroy=true"])


def test_tail_overlap_with_partial_rollouts_is_refused_as_a_pair():
    """Both orders of fixing max_off_policy_steps get the one message naming the two modes (it used to ask for
    >= 2 with partial rollouts and for 0 with the tail overlap)."""
    for k in (0, 2):
        cfg = apply_overrides(
            config_from_dict({"model": {"preset": "tiny"}}),
            [
                "algorithm.partial_rollouts=true",
                "algorithm.overlap=tail",
                f"algorithm.max_off_policy_steps={k}",
            ],
        )
        with pytest.raises(ConfigError, match='cannot be combined with algorithm.overlap = "tail"'):
            cfg.validate()


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in (
        "plan",
        "twin",
        "train",
        "sft",
        "eval",
        "parity",
        "report",
        "bench",
        "generate",
        "init-model",
    ):
        assert f" {name} |" in text or f"| {name}." in text, name


def _doc_row(doc: str, start: str) -> str:
    """The row of the 30B table (the one under its `| train.offload | generation |` header) that starts so."""
    table = doc[doc.index("| train.offload | generation | training | optimizer | host, pinned |") :]
    return next(line for line in table.splitlines() if line.startswith(start))


def test_docs_memory_figures_are_what_plan_prints(capsys):
    """docs/memory.md's qwen3-30b-a3b table (8 x 80 GB, offload off and on, host pinned) and the qwen3-8b
    one-GPU combination are `exactrl plan`'s output: regenerated by the commands the page gives."""
    doc = (ROOT / "docs" / "memory.md").read_text()
    f = lambda n: f"{n / GiB:.2f}"  # noqa: E731
    base = ["model.preset=qwen3-30b-a3b", "model.dtype=bfloat16", "run.device=cuda"]
    base += ["algorithm.rollouts_per_step=128", "engine.max_model_len=1024", "sampling.max_tokens=512"]
    base += ["train.fsdp_reduce=microbatch"]
    for off in ("none", "optimizer"):
        args = [x for s in [*base, f"train.offload={off}"] for x in ("--set", s)]
        rc, out, _ = plan_cli(capsys, *args, "--nproc", "8", "--gpu-memory", "79.18", "--host-memory", "1024")
        j = json.loads(out[-1])["memory_plan"]
        cells = [c.strip() for c in _doc_row(doc, f"| {off} |").split("|")[2:-1]]
        gen, train_, step, host = cells
        ph = j["phases"]
        assert gen.startswith(f"{f(ph['generation']['peak_bytes'])}:")
        assert f"replica {f(ph['generation']['engine_replica'])}" in gen
        assert train_ == f(ph["training"]["peak_bytes"])
        assert step.startswith(f(ph["optimizer"]["peak_bytes"]))
        if off == "optimizer":
            assert host.startswith(f"{f(j['host_pinned_bytes'])} per rank")
            assert f"{f(8 * j['host_pinned_bytes'])} for the node's 8 ranks" in host
        else:
            assert host == "-" and j["host_pinned_bytes"] == 0
    rc, out, _ = plan_cli(
        capsys, "--set", "model.preset=qwen3-8b", "--gpu-memory", "80", "--host-memory", "125"
    )
    together = [s for s in json.loads(out[-1])["memory_plan"]["suggestions"] if s.endswith("GiB)")][-1]
    assert together.startswith(
        "model.dtype=bfloat16 train.activation_checkpointing=true train.offload=optimizer"
    )
    peak = together.rsplit("(peak ", 1)[1].rstrip(")")
    assert f"together (peak {peak})" in " ".join(doc.split())


def test_a_disaggregated_plan_shards_over_the_trainers_alone(capsys):
    """`exactrl plan --nproc 3` with one generator rank plans the 2 trainers' FSDP2 shards (1/2 each, as the run's
    own check does), not 1/3; a layout with no rank left to train is refused before anything starts."""
    gen = ["--set", "model.preset=qwen3-8b", "--gpu-memory", "139"]
    rc, out, _ = plan_cli(capsys, *gen, "--nproc", "3", "--set", "distributed.generator_ranks=1")
    assert "planned for the 2 trainer ranks of 3" in "\n".join(out)
    dis = json.loads(out[-1])["memory_plan"]
    rc, out, _ = plan_cli(capsys, *gen, "--nproc", "2")
    co = json.loads(out[-1])["memory_plan"]
    assert dis["world_size"] == co["world_size"] == 2
    assert dis["phases"]["training"]["policy_shards"] == co["phases"]["training"]["policy_shards"]
    rc, out, err = plan_cli(capsys, *gen, "--nproc", "2", "--set", "distributed.generator_ranks=2")
    assert rc != 0 and "leaves no rank to train" in err + "\n".join(out)


def test_an_environment_call_longer_than_a_collectives_wait_is_refused_at_several_ranks():
    """At several ranks the others wait for a rank's environment calls in a collective (a split engine's lockstep
    every turn round): a first call may take 2 x env.timeout_s, refused where that reaches the process group's
    timeout; one rank, or a shorter limit, runs."""
    from exactrl.train.preflight import check_run_config

    slow = ["env.name=guess", "env.timeout_s=900"]
    with pytest.raises(ValueError, match=r"env.timeout_s = 900 under torchrun: .* below 900"):
        check_run_config(load_config(QUICKSTART, slow), 2, distributed=True)
    # One trainer and generator ranks (the count passed is the trainers'): the generators wait in lockstep too.
    with pytest.raises(ValueError, match=r"env.timeout_s = 900 under torchrun"):
        check_run_config(
            load_config(QUICKSTART, [*slow, "distributed.generator_ranks=1"]), 1, distributed=True
        )
    check_run_config(load_config(QUICKSTART, slow), 1, distributed=False)
    check_run_config(load_config(QUICKSTART, ["env.name=guess", "env.timeout_s=899"]), 2, distributed=True)
