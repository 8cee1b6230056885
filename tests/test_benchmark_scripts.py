"""Every script in benchmarks/ answers --help on a machine without a GPU, names only things that exist, and has a
dry run here: on the CPU (a tiny preset, --device cpu, Triton's interpreter) or over recorded result files. A
probe of CUDA kernels, streams or graphs that has no CPU path refuses in one line instead (`_script.require_cuda`).
A refactor that breaks a script's imports, its arguments or its CPU path fails here, not on a lent GPU."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
RESULTS = BENCH / "results"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))


def _run(script: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 300):
    # As on a machine without a GPU: no CUDA, and Triton's interpreter only where the dry run asks for it (the
    # suite's conftest sets TRITON_INTERPRET=1 for its own process on a CPU).
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    full.update({"CUDA_VISIBLE_DEVICES": "", **(env or {})})
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), full.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=ROOT,
        env=full,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Runs each script as __main__ with its arguments, one after another in one interpreter (torch imported once,
# not once per script): {script: [its exit code (or the exception that escaped, with its traceback), what it
# printed]}. A script's main that returns without exiting counts as exit code 0.
MAIN_DRIVER = """
import contextlib, io, json, runpy, sys, traceback
runs, out = json.loads(sys.argv[1]), {}
for path, args in runs:
    sys.argv = [path, *args]
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else f"SystemExit: {e.code}"
    except BaseException as e:
        code = f"{type(e).__name__}: {e}\\n" + traceback.format_exc()[-3000:]
    text = buf.getvalue()
    out[path] = [code or 0, text[:300] if not code else text[-3000:]]
print(json.dumps(out))
"""


def _run_mains(
    scripts: list[str],
    args: list[str],
    per_script: dict[str, list[str]] | None = None,
    env=None,
    timeout: float = 300,
) -> dict[str, list]:
    """`MAIN_DRIVER` over `scripts`, each with `args` (or its own, per_script); env: extra environment."""
    full = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as in _run
    full.update({"CUDA_VISIBLE_DEVICES": "", **(env or {})})
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(BENCH), full.get("PYTHONPATH", "")])
    runs = [[str(BENCH / s), (per_script or {}).get(s, args)] for s in scripts]
    cmd = [sys.executable, "-c", MAIN_DRIVER, json.dumps(runs)]
    res = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return {Path(k).name: v for k, v in json.loads(res.stdout.strip().splitlines()[-1]).items()}


@pytest.fixture(scope="module")
def help_answers() -> dict[str, list]:
    return _run_mains(SCRIPTS, ["--help"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_without_a_gpu(script, help_answers):
    code, text = help_answers[script]
    assert code == 0, f"{script} --help: {code}"
    assert text.startswith("usage:"), text


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_name_a_script_imports_exists(script):
    """Imports anywhere in a script (main's lazy ones included) from exactrl or from a sibling script name things
    that exist: a GPU-only probe that a refactor broke fails here (profile_vs_torch imported a `_sync` that
    train_vs_torch no longer had)."""
    missing = []
    for node in ast.walk(ast.parse((BENCH / script).read_text())):
        if not isinstance(node, ast.ImportFrom) or node.module is None:
            continue
        sibling = BENCH / f"{node.module}.py"
        if sibling.is_file():
            have = _top_level_names(sibling)
            missing += [f"{node.module}.{a.name}" for a in node.names if a.name not in have]
        elif node.module.split(".")[0] == "exactrl":
            module = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(module, a.name):
                    try:  # a submodule not imported by its package
                        importlib.import_module(f"{node.module}.{a.name}")
                    except ImportError:
                        missing.append(f"{node.module}.{a.name}")
    assert not missing, f"{script} imports names that do not exist: {missing}"


def _metrics_run(tmp: Path) -> list[str]:
    """A run directory whose metrics.jsonl has the step lines `exactrl train` writes (the keys step_split reads)."""
    run = tmp / "run"
    run.mkdir()
    rows = [
        {
            "step": s,
            "perf/generate_s": 1.0 + s,
            "perf/train_s": 0.5,
            "perf/optimizer_s": 0.1,
            "perf/step_s": 1.7 + s,
        }
        for s in (1, 2, 3)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(run)]


def _trace(tmp: Path) -> list[str]:
    """A Chrome trace as torch.profiler writes it: two kernels with a gap, and the host op running in the gap."""
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gemm_b", "ts": 400, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 120, "dur": 250},
    ]
    path = tmp / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return [str(path), "--min-us", "10"]


def _multirank_record(tmp: Path) -> list[str]:
    """A real `exactrl bench rollout --nproc 2` record (CPU ranks), the input scaling_table reads."""
    from exactrl.cli import main

    out = tmp / "out"
    args = [
        "bench",
        "rollout",
        "--preset",
        "tiny",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--concurrency",
        "2",
    ]
    args += ["--prompt-len", "8", "--max-tokens", "4", "--out-dir", str(out), "--nproc", "2"]
    assert main(args) == 0
    return [str(p) for p in sorted(out.glob("*.json"))]


TINY = ["--preset", "tiny"]
# script -> (arguments, or a function of a temporary folder that makes the input files and returns them; extra
# environment; extended: a heavier dry run, left out of `make test`). GPU-only probes are in GPU_ONLY below.
DRY_RUNS: dict[str, tuple[list[str] | Callable[[Path], list[str]], dict[str, str], bool]] = {
    "bench_check.py": (
        [
            str(RESULTS / "rollout-qwen3-0.6b-exact-sweep-NVIDIA-H100-80GB-HBM3.jsonl"),
            "--results",
            str(RESULTS),
        ],
        {},
        False,
    ),
    "bench_guard.py": (
        [
            *TINY,
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--prompts",
            "2",
            "--n",
            "2",
            "--prompt-len",
            "8",
            "--max-tokens",
            "4",
            "--reps",
            "1",
        ],
        {},
        False,
    ),  # fmt: skip
    "fp8_decode.py": (
        [
            "--device",
            "cpu",
            "--presets",
            "tiny",
            "--dtype",
            "float32",
            "--concurrency",
            "1",
            "--prompt-len",
            "8",
            "--max-tokens",
            "4",
        ],
        {},
        True,  # two engines (dtype, fp8) on the CPU, each with its warm-up call: about 10 s on 2 idle cores
    ),  # fmt: skip
    "mismatch_vs_length.py": ([*TINY, "--prompts", "1", "--samples", "2", "--lengths", "4"], {}, False),
    "plot_price.py": (
        lambda tmp: [
            str(RESULTS / "price-rollout-qwen3-0.6b-split-kv-NVIDIA-H100-80GB-HBM3.jsonl"),
            str(RESULTS / "price-train-split-kv-NVIDIA-H100-80GB-HBM3.jsonl"),
            "--png",
            str(tmp / "price.png"),
        ],
        {},
        False,
    ),
    "probe_adamw.py": (
        [*TINY, "--iters", "1"],
        {"TRITON_INTERPRET": "1"},
        True,  # seven launch shapes over the tiny preset's 0.85M parameters in the interpreter: about 20 s
    ),
    "profile_vs_torch.py": (
        ["--device", "cpu", *TINY, "--steps", "1", "--tokens", "64", "--modes", "exact"],
        {},
        True,  # compiles the stock step with inductor on the CPU: about a minute on 2 cores
    ),
    "probe_logprob_split.py": (
        ["--vocab", "12288", "--rows", "1,3", "--chunks", "4096,8192"],
        {"TRITON_INTERPRET": "1"},
        False,
    ),
    "probe_sampler.py": (["--vocab", "4096", "--rows", "1,3"], {"TRITON_INTERPRET": "1"}, False),
    "decode_split.py": (
        [
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--concurrency",
            "2",
            "--max-tokens",
            "4",
        ],
        {},
        False,
    ),
    "load_bandwidth.py": (
        lambda tmp: ["--preset", "tiny", "--device", "cpu", "--dtype", "float32", "--dir", str(tmp / "ckpt")],
        {},
        False,
    ),
    "probe_host_side.py": (
        ["--device", "cpu", "--preset", "tiny", "--tokens", "128", "--warmup", "1"],
        {},
        True,  # one profiled training step
    ),
    "profile_steps.py": (
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            *TINY,
            "--concurrency",
            "2",
            "--prompt-len",
            "8",
            "--max-tokens",
            "4",
            "--train-tokens",
            "64",
            "--top",
            "3",
        ],
        {},
        True,  # a model's train steps under the profiler: the heavier dry runs
    ),  # fmt: skip
    "scaling_table.py": (_multirank_record, {}, True),  # two CPU ranks under torchrun first
    "step_split.py": (_metrics_run, {}, False),
    "trace_gaps.py": (_trace, {}, False),
    "train_vs_torch.py": (
        [
            "--device",
            "cpu",
            *TINY,
            "--repeats",
            "1",
            "--steps",
            "1",
            "--tokens",
            "64",
            "--which",
            "exact",
            "fast",
        ],
        {},
        False,
    ),
}
# Probes of CUDA kernels, streams, graphs or device memory with no CPU path: on a CPU they say so in one line.
GPU_ONLY = {
    "bench_kernels.py",
    "plan_check.py",
    "probe_decode_attn.py",
    "probe_decode_gemm.py",
    "probe_fp8_decode_tiles.py",
    "probe_fp8_gemm.py",
    "probe_fp8_swap.py",
    "probe_l2_prefetch.py",
    "probe_moe.py",
    "probe_priority.py",
    "probe_sm_reserve.py",
}


def test_every_script_has_a_dry_run_or_is_declared_gpu_only():
    assert set(DRY_RUNS) | GPU_ONLY == set(SCRIPTS), "a script without a dry run: add it to DRY_RUNS"
    assert not set(DRY_RUNS) & GPU_ONLY


LIGHT = sorted(s for s, (_, _, extended) in DRY_RUNS.items() if not extended)


@pytest.fixture(scope="module")
def light_dry_runs(tmp_path_factory) -> dict[str, list]:
    """The light dry runs, one interpreter per extra environment (Triton's interpreter or not): torch imported
    twice in all instead of once per script (about 20 s of `make test` on 2 cores)."""
    out: dict[str, list] = {}
    for env in ({}, {"TRITON_INTERPRET": "1"}):
        scripts = [s for s in LIGHT if DRY_RUNS[s][1] == env]
        per: dict[str, list[str]] = {}
        for s in scripts:
            args = DRY_RUNS[s][0]
            per[s] = args(tmp_path_factory.mktemp(s.removesuffix(".py"))) if callable(args) else args
        out |= _run_mains(
            scripts, [], per, env, timeout=150 * len(scripts)
        )  # each script's former limit, halved
    assert set(out) == set(LIGHT), "a light dry run's extra environment is neither {} nor the interpreter's"
    return out


@pytest.mark.parametrize("script", LIGHT)
def test_dry_run_on_the_cpu(script, light_dry_runs):
    code, text = light_dry_runs[script]
    assert code == 0, f"{script}: {code}\n{text}"
    assert text.strip(), f"{script} printed nothing"


@pytest.mark.extended
@pytest.mark.parametrize("script", sorted(set(DRY_RUNS) - set(LIGHT)))
def test_heavy_dry_run_on_the_cpu(script, tmp_path):
    args, env, _ = DRY_RUNS[script]
    res = _run(script, args(tmp_path) if callable(args) else args, env)
    assert res.returncode == 0, f"{script}:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    assert res.stdout.strip(), f"{script} printed nothing"


@pytest.fixture(scope="module")
def gpu_only_answers() -> dict[str, list]:
    return _run_mains(sorted(GPU_ONLY), [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU sees")
@pytest.mark.parametrize("script", sorted(GPU_ONLY))
def test_a_gpu_only_probe_refuses_in_one_line_on_a_cpu(script, gpu_only_answers):
    code, _ = gpu_only_answers[script]
    assert (
        code == f"SystemExit: {script}: needs a CUDA GPU (torch sees none here); --help says what it measures"
    )


def test_gpu_sh_names_only_scripts_that_exist():
    named = set(re.findall(r"benchmarks/(\w+\.py)", (BENCH / "gpu.sh").read_text()))
    assert named, "gpu.sh runs no script of benchmarks/: the pattern no longer matches how it names them"
    assert named <= set(SCRIPTS), f"gpu.sh runs scripts that are gone: {sorted(named - set(SCRIPTS))}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU sees")
def test_a_kernel_probe_without_the_interpreter_names_it():
    """The Triton probes that dry-run under the interpreter say how, on a CPU without TRITON_INTERPRET=1."""
    probes = sorted(s for s, (_, env, _) in DRY_RUNS.items() if env.get("TRITON_INTERPRET"))
    for script, (code, _) in _run_mains(probes, []).items():
        assert code == (
            f"SystemExit: {script}: needs a CUDA GPU, or TRITON_INTERPRET=1 for a dry run on the CPU with small "
            "sizes; --help says what it measures"
        ), f"{script}: {code}"


def test_decode_split_on_two_ranks_times_both_forms():
    # Two torchrun ranks: the split forms of decode_split.py (its dry run above is T = 1).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "benchmarks" / "decode_split.py"), "--preset", "tiny", "--device", "cpu"]
    cmd += ["--dtype", "float32", "--concurrency", "3", "--max-tokens", "6"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    recs = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert {r["form"] for r in recs} == {"gathered (exact)", "all-reduce (row-parallel)"}
    assert all(r["tensor_parallel"] == 2 and r["output_tokens"] > 0 for r in recs)


def test_gpu_sh_exactrl_commands_parse_with_todays_cli(tmp_path, monkeypatch):
    """Every `exactrl` command line of every gpu.sh target, as bash expands it (python3, torchrun and nvidia-smi
    replaced by stubs that record their arguments on a 2-GPU machine: nothing runs), names a command and flags the
    CLI has (each command's function, and the torchrun launch of `--nproc`, replaced by one that records it), and
    every script it runs exists."""
    from exactrl import cli, commands

    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    record = '#!/usr/bin/env bash\nprintf "%s\\037" "$(basename "$0")" "$@" >> "$STUB_LOG"; printf "\\036" >> "$STUB_LOG"\n'
    for name in ("python3", "torchrun"):
        (bin_dir / name).write_text(record)
    (bin_dir / "nvidia-smi").write_text(record + 'echo "GPU 0: stub"; echo "GPU 1: stub"\n')
    for p in bin_dir.iterdir():
        p.chmod(0o755)
    text = (BENCH / "gpu.sh").read_text()
    targets = re.findall(r"^  ([a-z][a-z-]*)\)$", text, re.MULTILINE)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "STUB_LOG": str(log)}
    env.update(OUT=str(tmp_path / "out"), MULTI_30B="1")
    res = subprocess.run(
        ["bash", str(BENCH / "gpu.sh"), *targets], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-2000:]
    calls = [c.split("\x1f")[:-1] for c in log.read_text().split("\x1e") if c]
    cli_calls = [c[3:] for c in calls if c[:3] == ["python3", "-m", "exactrl.cli"]]
    scripts = {c[1] for c in calls if c[0] == "python3" and c[1].startswith("benchmarks/")}
    scripts |= {a for c in calls if c[0] == "torchrun" for a in c if a.startswith("benchmarks/")}
    assert len(cli_calls) >= 20 and scripts, (len(cli_calls), scripts)
    assert {Path(s).name for s in scripts} <= set(SCRIPTS), sorted(scripts)
    seen: list[str] = []
    for mod, names in ((cli, ["cmd_parity"]), (commands, ["cmd_bench"])):
        for name in names:
            monkeypatch.setattr(mod, name, lambda args, _n=name: seen.append(_n) or 0)
    # --nproc N: the checks before the launch run, the launch is recorded
    monkeypatch.setattr(
        "exactrl.distributed.launch.launch", lambda nproc, module, argv: seen.append(module) or 0
    )
    for argv in cli_calls:
        assert cli.main(argv) == 0, argv
    assert len(seen) == len(cli_calls)


# A script computes on a GPU when it names the device (`cuda` as a word: "cuda_graphs" in a result's keys is not).
CUDA_SCRIPTS = [s for s in SCRIPTS if re.search(r"\bcuda\b", (BENCH / s).read_text())]
# What caps the host's threads as `exactrl` does on CUDA (benchmarks/_script.py): require_cuda and kernel_device
# call cap_host_threads; probe_host_side.py and train_vs_torch.py call limit_host_threads by their own options.
CAPS = {"require_cuda", "kernel_device", "cap_host_threads", "limit_host_threads"}


@pytest.mark.parametrize("script", CUDA_SCRIPTS)
def test_every_gpu_script_caps_the_host_threads_before_its_work(script):
    """A figure that a script reads with every core as torch's thread (one busy core halves it) is not the
    command's: each GPU script calls a capping function in its main, before it loads a model."""
    tree = ast.parse((BENCH / script).read_text())
    called = {
        n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", None)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    assert called & CAPS, (
        f"{script} computes on CUDA but never caps the host threads (_script.cap_host_threads)"
    )


def test_the_script_helpers_cap_the_threads_on_cuda(monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import _script
    finally:
        sys.path.remove(str(BENCH))
    from exactrl.distributed.env import HOST_THREADS_CUDA

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        for start in (lambda: _script.require_cuda("x.py"), lambda: _script.kernel_device("x.py")):
            torch.set_num_threads(HOST_THREADS_CUDA + 2)
            start()
            assert torch.get_num_threads() == HOST_THREADS_CUDA
        torch.set_num_threads(HOST_THREADS_CUDA + 2)
        assert _script.cap_host_threads("cpu") == HOST_THREADS_CUDA + 2  # a CPU dry run keeps its threads
    finally:
        torch.set_num_threads(before)
