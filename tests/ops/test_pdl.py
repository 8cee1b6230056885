"""Programmatic dependent launch (exactrl.ops.triton.common.pdl): every Triton kernel waits for the previous
kernel before touching memory, and every launch passes `pdl(device)`.

A kernel launched with PDL but without the wait could read its input before the kernel that writes it has
finished; a kernel that waits but is launched without the flag, or a launch that passes the flag to a kernel
without the wait, would be a silent mix. The source check runs everywhere; the GPU check runs a chain of
dependent kernels captured in a CUDA graph (each launch back to back, each reading what the one before wrote)
with PDL on and off and requires the same bits.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import exactrl.ops.triton as triton_pkg

KERNEL_DIR = Path(triton_pkg.__file__).parent


def _is_jit(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _kernels_and_launches() -> tuple[dict[str, ast.FunctionDef], list[tuple[str, ast.Call]]]:
    kernels, launches = {}, []
    for path in sorted(KERNEL_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                if any(_is_jit(d) for d in node.decorator_list):
                    kernels[f"{path.name}:{node.name}"] = node
            # kernel[grid](...) is a Call whose func is a Subscript of a Name ending in _kernel
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id.endswith("_kernel")
            ):
                launches.append((f"{path.name}:{node.func.value.id}", node))
    return kernels, launches


def _first_statement_is_wait(fn: ast.FunctionDef) -> bool:
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if not body or not isinstance(body[0], ast.Expr) or not isinstance(body[0].value, ast.Call):
        return False
    call = body[0].value
    return (
        isinstance(call.func, ast.Name)
        and call.func.id == "pdl_wait"
        and len(call.args) == 1
        and isinstance(call.args[0], ast.Name)
        and call.args[0].id == "USE_PDL"
    )


def test_every_kernel_waits_first_and_every_launch_passes_pdl():
    kernels, launches = _kernels_and_launches()
    assert len(kernels) >= 20 and len(launches) >= len(kernels)
    no_param = [k for k, fn in kernels.items() if "USE_PDL" not in [a.arg for a in fn.args.args]]
    assert not no_param, f"kernels without a USE_PDL parameter: {no_param}"
    late = [k for k, fn in kernels.items() if not _first_statement_is_wait(fn)]
    assert not late, f"kernels whose first statement is not pdl_wait(USE_PDL): {late}"

    def passes_pdl(call: ast.Call) -> bool:
        return any(
            kw.arg is None
            and isinstance(kw.value, ast.Call)
            and isinstance(kw.value.func, ast.Name)
            and kw.value.func.id == "pdl"
            for kw in call.keywords
        )

    missing = [name for name, call in launches if not passes_pdl(call)]
    assert not missing, f"kernel launches without **pdl(device): {missing}"


def test_pdl_is_off_on_the_cpu():
    from exactrl.ops.triton.common import pdl, pdl_launches

    assert pdl(torch.device("cpu")) == {"USE_PDL": False}
    with pdl_launches():
        assert pdl(torch.device("cpu")) == {"USE_PDL": False}


def test_pdl_only_inside_the_scope_of_this_thread(monkeypatch):
    """`pdl` asks for the launch attribute only inside `pdl_launches` (the engine's steps), never outside (a
    training step), and a thread started inside a scope is outside it; the scope nests and restores."""
    import threading

    from exactrl.ops.triton import common

    monkeypatch.setattr(common, "_pdl_capable", lambda index: True)  # as on a Hopper GPU
    cuda = torch.device("cuda", 0)
    on = {"USE_PDL": True, "launch_pdl": True}
    assert common.pdl(cuda) == {"USE_PDL": False}
    with common.pdl_launches():
        assert common.pdl(cuda) == on
        with common.pdl_launches(False):
            assert common.pdl(cuda) == {"USE_PDL": False}
        assert common.pdl(cuda) == on
        other: list[dict] = []
        t = threading.Thread(target=lambda: other.append(common.pdl(cuda)))
        t.start()
        t.join()
        assert other == [{"USE_PDL": False}]
    assert common.pdl(cuda) == {"USE_PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_dependent_chain_in_a_graph_same_bits_with_and_without_pdl(monkeypatch):
    from exactrl.ops import set_exact_environment
    from exactrl.ops.triton import common
    from exactrl.ops.triton.matmul import matmul
    from exactrl.ops.triton.norm import rms_norm

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    set_exact_environment(True)
    g = torch.Generator(device="cuda").manual_seed(0)
    D, F = 1024, 3072
    ws = [(torch.randn(F, D, generator=g, device="cuda") * 0.03).bfloat16() for _ in range(4)]
    ws2 = [(torch.randn(D, F, generator=g, device="cuda") * 0.02).bfloat16() for _ in range(4)]
    norm_w = (1 + 0.1 * torch.randn(D, generator=g, device="cuda")).bfloat16()
    x0 = torch.randn(1, D, generator=g, device="cuda").bfloat16()

    def chain(x):
        # each kernel reads the output of the one just before it, the decode step's pattern at one sequence
        for i in range(24):
            x = rms_norm(matmul(matmul(x, ws[i % 4]), ws2[i % 4]), norm_w, 1e-6)
        return x

    def run_in_graph() -> torch.Tensor:
        static_x = x0.clone()
        chain(static_x)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x)
        outs = []
        for _ in range(5):
            graph.replay()
            outs.append(out.clone())
        torch.cuda.synchronize()
        return torch.stack(outs)

    # The reference: the eager chain with PDL as this process has it (on, on Hopper), before any switch.
    common._pdl_capable.cache_clear()
    with common.pdl_launches():
        pdl_default = common.pdl(torch.device("cuda"))["USE_PDL"]
    eager = chain(x0.clone())
    assert torch.isfinite(eager.float()).all()
    results = {}
    with monkeypatch.context() as m:
        for flag in ("1", "0"):
            m.setenv("EXACTRL_PDL", flag)
            common._pdl_capable.cache_clear()
            with common.pdl_launches():
                assert common.pdl(torch.device("cuda"))["USE_PDL"] is (flag == "1")
                results[flag] = run_in_graph()
    # The switch must not outlive the test: the tests after it in this process run with PDL as they found it.
    common._pdl_capable.cache_clear()
    with common.pdl_launches():
        assert common.pdl(torch.device("cuda"))["USE_PDL"] is pdl_default
    for flag, outs in results.items():
        for r in range(outs.shape[0]):
            assert torch.equal(outs[r], eager), f"EXACTRL_PDL={flag}: replay {r} differs from the eager chain"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_with_pdl_records_the_trainers_bits(monkeypatch):
    """The engine launches its kernels inside `pdl_launches` (each kernel's USE_PDL build), the trainer outside
    (the other build): the recorded logprobs must equal the trainer's with torch.equal, at qwen3-0.6b's real shapes
    (GQA 2, head dim 128, the 151,936-column vocabulary: the split logprob form; one and several sequences: split-KV
    decode, the 16-row decode tile, the decode GEMM tiles), from CUDA graphs. The engine with its scope forced off
    records the same bits. Control: the trainer at a temperature one part in a million away differs."""
    from exactrl.engine import engine as engine_mod
    from exactrl.engine.engine import EngineConfig, RolloutEngine
    from exactrl.engine.sampler import SamplingParams
    from exactrl.model import build_model, preset
    from exactrl.ops import set_exact_environment
    from exactrl.ops.triton import common
    from exactrl.train.packing import completion_logprobs

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    set_exact_environment(True)
    common._pdl_capable.cache_clear()
    model = build_model(preset("qwen3-0.6b"), device="cuda", dtype=torch.bfloat16, exact=True, seed=0)
    prompts = [[(13 * i + 7 * j) % 5000 + 10 for j in range(20 + 37 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.7, max_tokens=48, n=2, seed=11)

    def record() -> list[tuple[list[int], torch.Tensor]]:
        eng = RolloutEngine(model, EngineConfig(max_num_seqs=16, max_model_len=512))
        return [(s.token_ids, s.rollout_logprobs) for o in eng.generate(prompts, params) for s in o.samples]

    with_pdl = record()
    with monkeypatch.context() as m:
        m.setattr(engine_mod, "pdl_launches", lambda on=True: common.pdl_launches(False))
        without = record()
    seqs = [prompts[i // params.n] + t for i, (t, _) in enumerate(with_pdl)]
    plens = [len(prompts[i // params.n]) for i in range(len(with_pdl))]
    trainer = completion_logprobs(model, seqs, plens, temperature=0.7)
    for (ta, la), (tb, lb), lt in zip(with_pdl, without, trainer):
        assert ta == tb and torch.equal(la, lb), "the engine's PDL and plain builds recorded other bits"
        assert torch.equal(la, lt), "the engine (PDL) and the trainer (no PDL) disagree"
    off = completion_logprobs(model, seqs, plens, temperature=0.7 * (1 + 1e-6))
    assert any(not torch.equal(la, lo) for (_, la), lo in zip(with_pdl, off)), "control: the check can fail"
