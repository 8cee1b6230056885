"""The rollout engine split over 2 ranks (`engine.tensor_parallel = 2`, exactrl/distributed/tensor_parallel.py)
samples the tokens and records the logprobs of the one-device engine, `torch.equal`:

- the exact CPU `linear` gives a column slice of the weight the bits of the full weight's columns (what the
  column splits rest on), where a K split with a sum of partials does not (the control);
- on 2 gloo ranks (tests/distributed/_tp_driver.py): a dense fp32 Qwen3 (KV heads split), an fp32 Qwen2-MoE routing top-4 (q/k/v
  biases, shared expert split, routed experts replicated) and an fp32 Llama with fewer KV heads than ranks and a
  vocabulary T does not divide, with trained-looking weights, ragged prompts, T = 0.8, preemption, eager and
  static decode; the ranks agree; a shard loaded from full weights (the weight sync) samples the same, a stale
  one does not; and the negative control, o_proj / down_proj as row-parallel layers with all-reduced partial
  sums, records other logprobs on the same inputs;
- expert parallel (exactrl/distributed/expert_parallel.py) on that Qwen2-MoE, alone and with tensor parallel: the
  same bits, and its control (each rank's partial combine rounded to the model dtype, then all-reduced) differs;
  top-4 in fp32, so that a combine in another order than the one-device order shows (at top-2 two terms add alike
  in either order; in bf16 the final rounding hid a reversed combine here);
- what is not done is refused by key.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from exactrl.distributed.tensor_parallel import (
    HeadSplit,
    TensorParallelGroup,
    check_tensor_parallel,
    head_split,
    tensor_parallel_groups,
)
from exactrl.model import build_model, preset
from exactrl.ops.torch_ops import ExactTorchOps

from ._runs import ROOT, launch


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_slices_of_the_exact_linear_keep_their_bits(dtype: torch.dtype) -> None:
    ops, g = ExactTorchOps(), torch.Generator().manual_seed(0)
    k_split_differs = 0
    for k, n in [(128, 384), (96, 1000), (384, 128), (512, 256)]:
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
        for m in (1, 3, 7, 16, 17, 40):
            x = torch.randn(m, k, generator=g).to(dtype)
            full = ops.linear(x, w)
            for t in (2, 4):
                s = n // t
                for r in range(t):
                    cols = slice(r * s, (r + 1) * s)
                    assert torch.equal(ops.linear(x, w[cols].contiguous()), full[:, cols]), (k, n, m, t, r)
            # The control: K cut in two halves, partial products summed (a row-parallel layer's all-reduce).
            h = k // 2
            parts = ops.linear(x[:, :h].contiguous(), w[:, :h].contiguous()) + ops.linear(
                x[:, h:].contiguous(), w[:, h:].contiguous()
            )
            k_split_differs += not torch.equal(parts, full)
    assert k_split_differs > 0


def test_heads_split_over_ranks() -> None:
    assert head_split(4, 2, TensorParallelGroup(2, 1)) == HeadSplit(q0=2, num_heads=2, kv0=1, num_kv_heads=1)
    # fewer KV heads than ranks: each rank holds the one its query heads read
    assert [head_split(8, 2, TensorParallelGroup(4, r)) for r in range(4)] == [
        HeadSplit(0, 2, 0, 1),
        HeadSplit(2, 2, 0, 1),
        HeadSplit(4, 2, 1, 1),
        HeadSplit(6, 2, 1, 1),
    ]


@pytest.mark.parametrize(
    ("size", "overrides", "words"),
    [
        (3, {}, "4 attention heads"),
        (2, {"num_heads": 6, "num_kv_heads": 3, "hidden_size": 192}, "3 KV heads"),
        (4, {"intermediate_size": 386}, "intermediate_size 386"),
    ],
)
def test_shapes_tensor_parallel_cannot_split_are_refused(size: int, overrides: dict, words: str) -> None:
    model = build_model(preset("tiny", **overrides), exact=True)
    with pytest.raises(ValueError, match=rf"engine.tensor_parallel = {size}.*{words}"):
        check_tensor_parallel(model, size)


def test_a_world_size_tensor_parallel_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="engine.tensor_parallel = 2 does not divide the world size 3"):
        tensor_parallel_groups(0, 3, 2)


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
JOBS = [
    {"preset": "tiny", "dtype": "float32"},
    # LoRA on the attention projections (a MoE model's only targets): replicated under expert parallel. Top-4
    # routing in fp32: at the presets' top-2 a combine in another order than the one-device order adds alike, and
    # in bf16 the final rounding hid a combine in reverse order here (planted, 2026-11-29).
    {
        "preset": "tiny-qwen2-moe",
        "dtype": "float32",
        "overrides": {"num_experts_per_tok": 4},
        "expert_parallel": True,
        "lora": ATTENTION,
    },
    # LoRA on every projection: B split with its projection's rows (q/k/v, gate/up packed; o/down gathered).
    {
        "preset": "tiny-llama",
        "dtype": "float32",
        "overrides": {"num_kv_heads": 1, "vocab_size": 509},
        "lora": [*ATTENTION, "gate_proj", "up_proj", "down_proj"],
    },
]


def test_two_ranks_sample_the_one_device_bits(tmp_path) -> None:
    out = tmp_path / "tp.json"
    code, log, _ = launch(ROOT / "tests" / "distributed" / "_tp_driver.py", tmp_path, 2, JOBS, "tp", 300)
    assert code == 0, log[-6000:]
    results = json.loads(out.read_text()) if out.exists() else None
    assert results is not None, log[-3000:]
    for r in results:
        what = f"{r['preset']} {r['dtype']}"
        assert r["preemptions"] > 0 and r["tokens"] > 100, what  # the scheduler preempted, samples ran long
        for key in ("tp2", "tp2_static", "synced"):
            assert r[key]["tokens_equal"] and r[key]["logprobs_equal"], (what, key, r[key])
        # The negative controls: row-parallel partial sums change the logprobs; stale shards change the tokens.
        assert r["control"]["differ"] > 0, (what, r["control"])
        assert not r["stale"]["tokens_equal"], what
        assert r["params_held"] < 0.9 * r["params_full"], what  # the split holds a share, not a replica
        # The adapters change the samples: a split that dropped o_proj's / down_proj's differs.
        if "lora_off" in r:
            assert not r["lora_off"]["logprobs_equal"], (what, r["lora_off"])
        if (
            "ep2" in r
        ):  # expert parallel alone, and with tensor parallel (static decode), and loaded from full
            for key in ("ep2", "ep2_by_count", "tp2_ep2", "tp2_ep2_synced"):
                assert r[key]["tokens_equal"] and r[key]["logprobs_equal"], (what, key, r[key])
            # The control: each rank's partial combine rounded to the model dtype, then all-reduced.
            assert r["ep_control"]["differ"] > 0, (what, r["ep_control"])
            assert r["params_held_ep"] < r["params_held"], what


def test_expert_parallel_refuses_what_it_cannot_split() -> None:
    from exactrl.distributed.expert_parallel import check_expert_parallel

    with pytest.raises(ValueError, match="engine.expert_parallel = 2: the model has no sparse"):
        check_expert_parallel(build_model(preset("tiny"), exact=True), 2)
    with pytest.raises(ValueError, match="engine.expert_parallel = 3 does not divide the model's 8 experts"):
        check_expert_parallel(build_model(preset("tiny-moe"), exact=True), 3)


def test_an_expert_parallel_engine_decodes_in_cuda_graphs() -> None:
    # A decode step computes every slot on every rank (no data-dependent shape): the engine captures it. Picking
    # the rank's own slots by count (`nonzero`) had failed capture on 2 x H200, 2026-11-28.
    from types import SimpleNamespace

    from exactrl.distributed.expert_parallel import ExpertParallelExperts, shard_experts
    from exactrl.distributed.tensor_parallel import TensorParallelGroup
    from exactrl.engine.engine import default_decode_mode

    model = shard_experts(build_model(preset("tiny-moe"), exact=True), TensorParallelGroup(size=2, rank=0))
    assert any(isinstance(m, ExpertParallelExperts) for m in model.modules())
    split = SimpleNamespace(
        device=torch.device("cuda", 0), graph_capturable=getattr(model, "graph_capturable", True)
    )
    assert default_decode_mode(split, cuda_graphs=True) == "graph"
    assert default_decode_mode(split, cuda_graphs=False) == "eager"
    held_back = SimpleNamespace(device=torch.device("cuda", 0), graph_capturable=False)
    assert default_decode_mode(held_back, cuda_graphs=True) == "eager"


def test_parity_refuses_a_tensor_parallel_degree_that_does_not_divide_the_ranks(capsys) -> None:
    from exactrl.cli import main

    # Refused before torchrun starts anything.
    assert main(["parity", "--tensor-parallel", "3", "--nproc", "2"]) == 2
    assert "--tensor-parallel (engine.tensor_parallel = 3) must divide --nproc (2)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "world", "words"),
    [
        ([], 0, "needs torchrun ranks"),
        ([], 3, "does not divide the world size 3"),
        (["distributed.generator_ranks=1"], 2, "does not divide distributed.generator_ranks = 1"),
        (
            ["algorithm.max_off_policy_steps=1"],
            2,
            "max_off_policy_steps = 1: the next batch is sampled by a worker",
        ),
    ],
)
def test_train_refuses_what_a_shared_engine_does_not_run_by_key(
    extra: list[str], world: int, words: str
) -> None:
    from exactrl.config import load_config
    from exactrl.train.preflight import check_run_config

    cfg = load_config(ROOT / "configs" / "quickstart.toml", ["engine.tensor_parallel=2", *extra])
    with pytest.raises(ValueError, match=rf"engine.tensor_parallel = 2.*{re.escape(words)}"):
        check_run_config(cfg, max(world, 1), distributed=world > 0)
    # LoRA is not among them: its adapters split with their projections.
    lora = load_config(ROOT / "configs" / "quickstart.toml", ["engine.tensor_parallel=2", "lora.rank=4"])
    check_run_config(lora, 2, distributed=True)


def test_train_refuses_expert_parallel_where_it_cannot_split_by_key() -> None:
    from exactrl.config import ConfigError, load_config
    from exactrl.train.preflight import check_run_config

    quick = ROOT / "configs" / "quickstart.toml"
    cases = [
        (["engine.expert_parallel=2"], "engine.expert_parallel = 2: the model has no sparse"),
        (["model.preset=tiny-moe", "engine.expert_parallel=3"], "does not divide the model's 8 experts"),
    ]
    for sets, words in cases:
        with pytest.raises(ValueError, match=re.escape(words)):
            check_run_config(load_config(quick, sets), 6, distributed=True)
    with pytest.raises(ConfigError, match="engine.expert_parallel"):
        load_config(quick, ["model.preset=tiny-moe", "engine.expert_parallel=2", "engine.tensor_parallel=4"])


@pytest.mark.parametrize(
    "split",
    [
        # The fp8 run below splits the same model the same way (and quantizes the shards); a tensor-parallel engine
        # synced from FSDP2 shards in bf16 trains exactly in test_train_tensor_parallel: make test-all.
        pytest.param(["--tensor-parallel", "2"], marks=pytest.mark.extended),
        pytest.param(["--expert-parallel", "2"], marks=pytest.mark.extended),
        ["--tensor-parallel", "2", "--precision", "fp8"],
        pytest.param(["--expert-parallel", "2", "--precision", "fp8"], marks=pytest.mark.extended),
    ],
)
def test_parity_of_a_split_moe_engine_against_the_fsdp2_trainer(split: list[str]) -> None:
    """`exactrl parity --nproc 2 --tensor-parallel 2` (or `--expert-parallel 2`): the split engine's weights come
    from the FSDP2 trainer's shards through the weight sync, and every recorded logprob equals the trainer's (a
    mixture of experts in bf16: with tensor parallel the dense layer, the attention and the head split, the experts
    replicated; with expert parallel the routed experts split, the rest replicated). In fp8 a tensor-parallel
    shard's fp8 copy is its rows of the whole weight's (tiny-moe's 64 query rows a rank cut a 128-row block:
    quantized alone, every token differed); an expert shard quantizes its own experts (each expert is blocked on
    its own; without fp8 registered on the shard's stacks, every token differed). The splits' negative controls (row-parallel partial sums, partial expert combines) are
    _tp_driver's."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    argv = ["parity", "--nproc", "2", *split, "--device", "cpu", "--preset", "tiny-moe"]
    argv += ["--dtype", "bfloat16", "--num-prompts", "2", "--max-tokens", "6", "--samples-per-prompt", "2"]
    p = subprocess.run(
        [sys.executable, "-m", "exactrl.cli", *argv, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (r,) = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert r["ok"] and r["num_mismatched"] == 0 and r["num_tokens"] > 0, r
    key = split[0].removeprefix("--").replace("-", "_")
    assert r[key] == 2 and r["world_size"] == 2, r
    assert r["precision"] == ("fp8" if "fp8" in split else "dtype"), r
