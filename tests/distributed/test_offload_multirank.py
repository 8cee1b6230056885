"""`train.offload = "optimizer"` under torchrun on CPU ranks (gloo): each rank's AdamW moment shards wait in host
buffers between optimizer steps and come to the device for the step (exactrl/train/optim.py).

- world size 2 (default run): offload on equals offload off in every metric and weight bit over a few RL steps,
  no mismatched token; during each step the moments are device buffers, after it they are the host buffers on
  every rank; moments rounded to bf16 while they wait (a planted bug) change the run: the negative control;
- resume (slow): a run with offload on, crashed after step 2 and resumed with it on, continues bit for bit; a run
  saved with offload off resumes with it on, and the reverse, as the uninterrupted run.

On a CPU host and device are one memory, so "on the host" is seen as the tensor being the optimizer's host buffer
(the step reads fresh buffers it copied into, as on a GPU); pinned memory and the copies' asynchrony are the GPU's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ._runs import REWARD, ROOT, SMALL_BF16, launch
from ._runs import crashed_after as _crashed_after
from ._runs import mismatched as _mismatched
from ._runs import records as _records
from ._runs import same as _same
from ._runs import small_argv as _argv

DRIVER = Path(__file__).with_name("_offload_driver.py")
SMALL = SMALL_BF16
ON = "train.offload=optimizer"
OFF = "train.offload=none"


def _launch(
    tmp: Path, jobs: list[dict], tag: str, nproc: int = 2, timeout: float = 300
) -> tuple[int, str, float]:
    return launch(DRIVER, tmp, nproc, jobs, tag, timeout)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "reward.py").write_text(REWARD)
    return tmp_path


@pytest.mark.extended  # one process: tests/train/test_plan.py runs the offload bitwise by default
def test_offload_is_exact_and_moves_the_moment_shards_at_world_size_2(tmp):
    steps = 3
    jobs = [
        {"kind": "cli", "argv": _argv(tmp, "off", steps, OFF)},
        # Groups of at most 256 KiB of masters' worth: the step streams the moment shards in several groups.
        {
            "kind": "cli",
            "argv": _argv(tmp, "on", steps, ON),
            "probe": str(tmp / "probe-on"),
            "chunk_bytes": 1 << 18,
        },
        {"kind": "cli", "argv": _argv(tmp, "off2", 1, OFF), "probe": str(tmp / "probe-off")},
        # Negative control: moments rounded to bf16 while on the host.
        {"kind": "cli", "argv": _argv(tmp, "lossy", steps, ON), "plant": "lossy_host"},
    ]
    code, out, secs = _launch(tmp, jobs, "ws2")
    print(f"world size 2: {secs:.1f} s")
    assert code == 0, out[-6000:]
    assert sum("loss" in r for r in _records(tmp / "on")) == steps
    assert _same(tmp / "off", tmp / "on")
    assert _mismatched(tmp / "on") == 0
    for rank in (0, 1):
        probe = json.loads((tmp / "probe-on" / f"rank{rank}.json").read_text())
        assert len(probe) == steps, probe
        for s in probe:
            assert s["sharded"] and s["streamed"]
            n = s["moments_after_step"]
            assert n > 0 and n % 2 == 0
            # The moments came to the device a group at a time (several groups), each group's as device buffers
            # while it stepped (none of them its host buffer; the first step makes them on the device), and
            # every moment was stepped in exactly one group; after the step every one waits in its host buffer.
            groups = s["groups"]
            assert len(groups) > 1 and sum(g["count"] for g in groups) == n
            assert all(g["in_host_buffers"] == 0 and g["count"] > 0 for g in groups)
            after = dict(s["after"])
            buffers = after.pop("host_buffer_bytes")
            assert after == {"count": n, "devices": ["cpu"], "in_host_buffers": n, "on_host": True}
            assert len(buffers) == n
        # Offload off: no host buffers at all.
        off = json.loads((tmp / "probe-off" / f"rank{rank}.json").read_text())
        assert off and off[0]["after"]["in_host_buffers"] == 0 and not off[0]["after"]["on_host"]
    assert not _same(tmp / "off", tmp / "lossy")
    # The plan's host term (on a GPU, where the buffers are pinned): the largest rank's host buffers, each as the
    # pinned allocator rounds it.
    from exactrl.config import load_config
    from exactrl.train.memory import pinned_bytes, plan_memory

    real = max(
        sum(
            map(
                pinned_bytes,
                json.loads((tmp / "probe-on" / f"rank{r}.json").read_text())[-1]["after"][
                    "host_buffer_bytes"
                ],
            )
        )
        for r in (0, 1)
    )
    cfg = load_config(ROOT / "configs" / "quickstart.toml", [*SMALL, ON])
    plan = plan_memory(cfg, world_size=2, device="cuda")
    assert plan.host_pinned == real and plan.host_ranks == 2
    for name in ("generation", "training"):
        assert "policy_adamw_moments" not in plan.phase(name).terms
    # The optimizer phase holds one group of the streamed moment shards (MasterAdamW._sharded_update).
    assert "policy_adamw_moments" not in plan.phase("optimizer").terms
    assert 0 < plan.phase("optimizer").terms["optimizer_state_chunk"] <= plan.host_pinned


@pytest.mark.slow
@pytest.mark.extended  # resume at world size 2 is covered by test_phases_multirank's and test_multirank's
def test_resume_with_offload_continues_bitwise_at_world_size_2(tmp):
    steps, ckpt = 4, "train.save_every=1"
    jobs = [
        {"kind": "cli", "argv": _argv(tmp, "whole-on", steps, ON, ckpt)},
        {"kind": "cli", "argv": _argv(tmp, "whole-off", steps, OFF, ckpt)},
    ]
    code, out, _ = _launch(tmp, jobs, "whole")
    assert code == 0, out[-6000:]
    assert _same(tmp / "whole-on", tmp / "whole-off")
    # A crash right after step 2's checkpoint; --resume with offload on (from an on and an off run) and off (from
    # an on run): the checkpoint does not depend on where the moments waited.
    resumes = {"on-on": ("whole-on", ON), "off-on": ("whole-off", ON), "on-off": ("whole-on", OFF)}
    for name, (src, _) in resumes.items():
        _crashed_after(tmp / src, tmp / name, 2)
    jobs = [
        {"kind": "cli", "argv": _argv(tmp, name, steps, mode, ckpt, resume=True)}
        for name, (_, mode) in resumes.items()
    ]
    code, out, _ = _launch(tmp, jobs, "resume")
    assert code == 0, out[-6000:]
    for name, (src, _) in resumes.items():
        assert _same(tmp / src, tmp / name), name
