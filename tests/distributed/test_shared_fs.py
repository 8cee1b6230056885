"""The checks of exactrl/distributed/shared_fs.py on one process: a sharded checkpoint's files against its
metadata (a shard removed or cut short is named), a resume from such a checkpoint refused by name before anything
changes, a checkpoint without every shard never published. The multi-rank cases (a rank that cannot see the run
directory, a 2-rank checkpoint with a shard removed, resumed through `exactrl train`) run in
tests/distributed/test_multirank.py's launches."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from exactrl.distributed.env import DistContext
from exactrl.distributed.shared_fs import (
    IncompleteCheckpointError,
    SharedFilesystemError,
    agree,
    agreed_checkpoint,
    check_shared_run_dir,
    missing_shards,
    require_every_shard,
)


def _checkpoint(root: Path) -> Path:
    """step-000001/ with a dcp/ of two tensors (one process writes one shard file and the metadata)."""
    ck = root / "step-000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says it runs on one process
        dcp.save({"a": torch.arange(64.0), "b": torch.ones(3, 5)}, checkpoint_id=str(ck / "dcp"))
    return ck


def test_a_whole_checkpoint_has_nothing_missing_and_resumes(tmp_path):
    ck = _checkpoint(tmp_path)
    shards = sorted(p.name for p in (ck / "dcp").glob("*.distcp"))
    assert shards and missing_shards(ck) == []
    assert agreed_checkpoint(DistContext.single(), lambda: ck) == ck
    assert missing_shards(tmp_path / "single-device") == []  # no dcp/: nothing sharded to check


def test_a_checkpoint_with_a_shard_removed_or_cut_is_refused_by_name(tmp_path):
    ck = _checkpoint(tmp_path)
    (shard,) = (ck / "dcp").glob("*.distcp")
    data = shard.read_bytes()
    shard.write_bytes(data[:-8])  # cut short: the metadata's offsets run past its end
    assert missing_shards(ck) == [f"dcp/{shard.name}"]
    shard.unlink()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(IncompleteCheckpointError) as err:
        agreed_checkpoint(DistContext.single(), lambda: ck)
    assert f"cannot resume from {ck}: shard dcp/{shard.name} is missing" in str(err.value)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing changed
    (ck / "dcp" / ".metadata").unlink()
    assert missing_shards(ck) == ["dcp/.metadata"]


def test_a_checkpoint_without_every_shard_is_not_published(tmp_path):
    ck = _checkpoint(tmp_path)
    require_every_shard(DistContext.single(), ck, "step-000001")  # whole: no error
    for f in (ck / "dcp").glob("*.distcp"):
        f.unlink()
    with pytest.raises(
        IncompleteCheckpointError, match=r"checkpoint step-000001 not published: dcp/__0_0\.distcp"
    ):
        require_every_shard(DistContext.single(), ck, "step-000001")


def test_agree_gives_rank_0s_answer_or_error():
    assert agree(DistContext.single(), lambda: 3) == 3
    with pytest.raises(ValueError, match="rank 0's"):
        agree(DistContext.single(), lambda: (_ for _ in ()).throw(ValueError("rank 0's")))


class _TwoRanks:
    """Rank 0 of two whose peer sees what it sees (a collective hands every rank rank 0's object)."""

    distributed, world_size, is_main = True, 2, True

    def all_gather_object(self, obj):
        return [obj, obj]


def test_rank_0_that_cannot_write_the_run_directory_says_so_not_that_a_node_is_blind(tmp_path):
    check_shared_run_dir(_TwoRanks(), tmp_path / "run")  # the control: writable, seen, nothing left behind
    assert not (tmp_path / "run").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(SharedFilesystemError, match="rank 0 cannot write in the run directory") as e:
        check_shared_run_dir(_TwoRanks(), tmp_path / "file" / "run")  # under a file: mkdir fails
    assert "cannot see" not in str(e.value)
