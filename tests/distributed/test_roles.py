"""The launcher's one line of what each rank does (exactrl.distributed.roles): which ranks train, which generate
and for whom, the engine split, the devices; printed once by `exactrl ... --nproc N` before the ranks start."""

from __future__ import annotations

import re

import pytest

from exactrl import cli
from exactrl.distributed import launch
from exactrl.distributed.env import DistContext
from exactrl.distributed.layout import Layout
from exactrl.distributed.roles import Roles, roles_line


def test_the_line_names_roles_engines_and_devices():
    assert roles_line(3, Roles("cuda", generator_ranks=1)) == (
        "exactrl: 3 ranks: ranks 0-1 train (FSDP2 over 2 ranks); rank 2 generates (T=1 E=1) for trainers 0-1; "
        "on one GPU each, cuda:0-2 by LOCAL_RANK"
    )
    assert roles_line(4, Roles("cpu", tensor_parallel=2)) == (
        "exactrl: 4 ranks: ranks 0-3 train (FSDP2 over 4 ranks) and generate (2 engines of 2 ranks, T=2 E=1); "
        "on the CPU (gloo)"
    )
    assert roles_line(2, Roles("cuda", trains=False)) == (
        "exactrl: 2 ranks: ranks 0-1 generate (an engine each, T=1 E=1); on one GPU each, cuda:0-1 by LOCAL_RANK"
    )
    # Two nodes of 8: each node's ranks take its own cuda:0-7, not cuda:0-15.
    assert roles_line(16, Roles("cuda"), per_node=8).endswith(
        "on one GPU each, cuda:0-7 by LOCAL_RANK on each of 2 nodes"
    )


@pytest.mark.parametrize(("world", "generators", "split"), [(3, 1, 1), (5, 2, 1), (7, 4, 2), (6, 2, 2)])
def test_the_generators_serve_the_trainers_the_layout_gives_them(world, generators, split):
    """The line's "for trainers ..." is the layout's own mapping (Layout.trainers_of), uneven shares included."""
    line = roles_line(world, Roles("cpu", generators, tensor_parallel=split))
    layout = Layout(DistContext(0, world), generators, "trainer", DistContext(0, world), group_size=split)
    for first in range(layout.trainers, world, split):
        own = f"rank {first}" if split == 1 else f"ranks {first}-{first + split - 1}"
        served = layout.trainers_of(first)
        said = re.search(rf"{own} generates? \([^)]*\) for trainers? ([\d, -]+?)(;|$)", line)
        assert said, line
        text = said.group(1)
        got = (
            list(range(int(text.split("-")[0]), int(text.split("-")[1]) + 1))
            if "-" in text
            else [int(r) for r in text.split(", ")]
        )
        assert got == served, line


def test_a_launch_prints_the_line_once_before_the_ranks_start(monkeypatch, tmp_path, capsys):
    started = []
    monkeypatch.setattr(launch, "launch", lambda nodes, module, argv: started.append(nodes.world_size) or 0)
    argv = ["train", "configs/quickstart.toml", "--set", f"run.output_dir={tmp_path / 'run'}", "--set",
            "distributed.generator_ranks=1", "--nproc", "3"]  # fmt: skip
    assert cli.main(argv) == 0 and started == [3]
    err = capsys.readouterr().err
    assert err.count("exactrl: 3 ranks:") == 1, err
    assert (
        "ranks 0-1 train (FSDP2 over 2 ranks); rank 2 generates (T=1 E=1) for trainers 0-1; on the CPU" in err
    )
    assert cli.main(["bench", "rollout", "--preset", "tiny", "--device", "cpu", "--nproc", "2"]) == 0
    assert (
        "exactrl: 2 ranks: ranks 0-1 generate (an engine each, T=1 E=1); on the CPU (gloo)"
        in capsys.readouterr().err
    )
