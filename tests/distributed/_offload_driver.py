"""The optimizer-offload jobs of tests/distributed/test_offload_multirank.py, under `python -m torch.distributed.run`:
`_driver.py`'s cli jobs, with an optional probe of where the optimizer state sits and an optional planted bug.

    {"kind": "cli", "argv": [...], "probe": "DIR", "plant": NAME, "chunk_bytes": N}
      probe        every rank writes DIR/rank<r>.json: per optimizer step of the policy's MasterAdamW, where each
                   group's AdamW moments were while the group stepped (as they go back to the host: device type,
                   whether each tensor is the optimizer's host buffer for it), where all of them were right after
                   the step, and the bytes of each of its host buffers
      "lossy_host" the moments are rounded to bf16 while they wait in their host buffers: the negative control
      chunk_bytes  the offloaded step's group size (MasterAdamW's offload_chunk_bytes), small enough for several
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import _driver  # noqa: E402


def _moments(opt) -> list[tuple[tuple[int, str], torch.Tensor]]:
    out = []
    for i, m in enumerate(opt.master):
        st = opt.opt.state.get(m, {})
        out += [((i, name), st[name]) for name in ("exp_avg", "exp_avg_sq") if name in st]
    return out


def _where(opt) -> dict:
    """Where the moments are now: their device types, and how many are the host buffers `to_host` fills."""
    moments = _moments(opt)
    host = opt._host
    return {
        "count": len(moments),
        "devices": sorted({t.device.type for _, t in moments}),
        "in_host_buffers": sum(
            1 for k, t in moments if k in host and t.data_ptr() == host[k].data_ptr() and t.numel() > 0
        ),
        "on_host": opt.on_host,
        "host_buffer_bytes": sorted(t.numel() * t.element_size() for t in host.values()),
    }


def _install(probe: str | None, plant: str | None, chunk_bytes: int | None = None):
    """Patch MasterAdamW for the job; returns (the function that undoes it, the probe's records)."""
    from exactrl.train.optim import MasterAdamW

    real_step, real_sharded, real_to_host, real_init = (
        MasterAdamW.clip_and_step_async,
        MasterAdamW._sharded_step,
        MasterAdamW.to_host,
        MasterAdamW.__init__,
    )
    records: list[dict] = []
    to_host = real_to_host

    if chunk_bytes is not None:

        def init(self, *args, **kwargs):
            real_init(self, *args, **{**kwargs, "offload_chunk_bytes": chunk_bytes})

        MasterAdamW.__init__ = init
    if probe is not None:

        def sharded_step(self, max_norm, skip, streamed=False):
            self._probe_groups = groups = []
            try:
                out = real_sharded(self, max_norm, skip, streamed)
            finally:
                del self._probe_groups
            records.append(
                {"streamed": streamed, "groups": groups, "moments_after_step": len(_moments(self))}
            )
            return out

        def probed_to_host(self, idx=None):
            groups = getattr(self, "_probe_groups", None)
            if groups is not None and idx is not None:  # a group's moments, stepped, about to go back
                mine = set(idx)
                ts = [(k, t) for k, t in _moments(self) if k[0] in mine]
                groups.append(
                    {
                        "count": len(ts),
                        "in_host_buffers": sum(
                            1 for k, t in ts if k in self._host and t.data_ptr() == self._host[k].data_ptr()
                        ),
                    }
                )
            real_to_host(self, idx)

        to_host = probed_to_host
        MasterAdamW.to_host = probed_to_host

        def step(self, max_norm, skip=None):
            out = real_step(self, max_norm, skip)
            if records and "after" not in records[-1]:
                records[-1]["after"] = _where(self)
                records[-1]["sharded"] = self.sharded
            return out

        MasterAdamW._sharded_step = sharded_step
        MasterAdamW.clip_and_step_async = step
    if plant == "lossy_host":

        def lossy(self, idx=None):
            to_host(self, idx)
            for key, t in self._offloaded(idx):
                if key[1] != "master":
                    t.copy_(t.bfloat16().float())

        MasterAdamW.to_host = lossy
    elif plant is not None:
        raise ValueError(f"unknown plant {plant!r}")

    def undo():
        MasterAdamW.clip_and_step_async = real_step
        MasterAdamW._sharded_step = real_sharded
        MasterAdamW.to_host = real_to_host
        MasterAdamW.__init__ = real_init

    return undo, records


def main() -> None:
    import exactrl.cli

    leave = exactrl.cli._end_process_group
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    rank = int(os.environ["RANK"])
    for job in spec["jobs"]:
        undo, records = _install(job.get("probe"), job.get("plant"), job.get("chunk_bytes"))
        try:
            _driver.cli_job(job)
        finally:
            undo()
        if job.get("probe"):
            out = Path(job["probe"])
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{rank}.json").write_text(json.dumps(records))
    leave()


if __name__ == "__main__":
    main()
