"""A run directory every rank sees, checked, not assumed.

Under torchrun every rank reads and writes `run.output_dir`: each rank writes its own shard of a sharded
checkpoint there and rank 0 renames the folder into place; on resume every rank reads every shard (DCP reshards)
and, with a KL reference, the `sft/` that rank 0 wrote. On several machines that needs one filesystem that every
node mounts at the same path. When a node has its own disk instead, a run used to exit 0 with every checkpoint
missing that node's shard, and a resume failed in a long DCP traceback or hung until the collective timeout. Here:

- `check_shared_run_dir`: at start-up rank 0 writes a token with a random nonce into the run directory, shares the
  nonce over the process group and every rank reads the file at the same path: one line naming the path and the
  ranks (and hosts) that cannot see it, on every rank, when one cannot.
- `missing_shards`: the files a DCP checkpoint's metadata names that are absent or short. A checkpoint is
  published only when none is missing (`require_every_shard`, before the rename), and one with a shard missing is
  refused on resume before anything changes (`agreed_checkpoint`).
- `agree`: rank 0 decides (which checkpoint to resume from, where SFT stands) and every rank gets its answer, or its
  error: no rank looks for "latest" on its own disk.

Every function is a collective of the run's ranks (the trainers' group in a disaggregated run) and raises the same
error on every rank, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from exactrl.distributed.env import DistContext

T = TypeVar("T")

TOKEN_PREFIX = ".exactrl-shared-check-"  # removed again once every rank has read it


class SharedFilesystemError(ValueError):
    """A rank does not see what rank 0 wrote in the run directory."""


class IncompleteCheckpointError(ValueError):
    """A sharded checkpoint without every rank's shard (refused before it is published or loaded)."""


def agree(ctx: DistContext, decide: Callable[[], T]) -> T:
    """`decide()` on rank 0; its result, or the error it raised, on every rank (a collective)."""
    if not ctx.distributed:
        return decide()
    answer: Any = None
    if ctx.is_main:
        try:
            answer = ("ok", decide())
        except Exception as err:  # every rank raises it, not rank 0 alone while the others wait
            answer = ("error", err)
    kind, value = ctx.all_gather_object(answer)[0]
    if kind == "error":
        raise value
    return value


def _who(views: list[tuple[bool, str]], bad: list[int]) -> str:
    return ", ".join(f"{r} (on {views[r][1]})" for r in bad)


def check_shared_run_dir(ctx: DistContext, out_dir: Path) -> None:
    """Every rank proves it sees rank 0's run directory: rank 0 writes a token file with a random nonce there, the
    nonce goes to every rank over the process group, every rank reads the file at the same path. Nothing is left
    behind (the token, and the directory when this check made it). Raises SharedFilesystemError on every rank when
    a rank cannot see it."""
    if not ctx.distributed or ctx.world_size == 1:
        return
    out_dir = Path(out_dir)
    made: list[Path] = []
    token = None
    nonce = None
    failed: str | None = None  # rank 0's own error writing the token: that, not the filesystem, is the cause
    if ctx.is_main:
        made = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
        nonce = secrets.token_hex(16)
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            token = out_dir / f"{TOKEN_PREFIX}{nonce}"
            token.write_text(nonce)
        except OSError as e:
            token, failed = None, f"{type(e).__name__}: {e}"
            for p in made:  # deepest first, what this check made
                try:
                    p.rmdir()
                except OSError:
                    break
    nonce, failed = ctx.all_gather_object((nonce, failed))[0]
    if failed is not None:
        raise SharedFilesystemError(
            f"rank 0 cannot write in the run directory {out_dir} ({failed}): set run.output_dir to a directory "
            "every rank can write (and see: on several nodes a filesystem every node mounts at that path)"
        )
    try:
        seen = (out_dir / f"{TOKEN_PREFIX}{nonce}").read_text() == nonce
    except OSError:
        seen = False
    views = ctx.all_gather_object((seen, socket.gethostname()))
    if ctx.is_main:
        if token is not None:
            token.unlink(missing_ok=True)
        for p in made:  # deepest first: only the directories this check made, and only while empty
            try:
                p.rmdir()
            except OSError:
                break
    blind = [r for r, (ok, _) in enumerate(views) if not ok]
    if blind:
        raise SharedFilesystemError(
            f"rank(s) {_who(views, blind)} cannot see the run directory {out_dir} of rank 0 (on {views[0][1]}): a "
            "file rank 0 wrote there is not there for them. Every rank writes its checkpoint shards into "
            "run.output_dir and reads them back on resume, so it must be one filesystem every node mounts at "
            "that path (NFS, Lustre, a cluster's shared home): set run.output_dir to such a path"
        )


def missing_shards(checkpoint: Path) -> list[str]:
    """The files of `checkpoint`'s sharded state (dcp/, as its `.metadata` names them) that are absent or shorter
    than the metadata says, as paths relative to the checkpoint ("dcp/.metadata" when that is missing). Empty for a
    whole checkpoint, and for a single-device one (no dcp/)."""
    dcp_dir = Path(checkpoint) / "dcp"
    if not dcp_dir.is_dir():
        return []
    if not (dcp_dir / ".metadata").is_file():
        return ["dcp/.metadata"]
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(dcp_dir)).read_metadata()
    except Exception:  # an unreadable metadata file: the checkpoint is not whole
        return ["dcp/.metadata"]
    need: dict[str, int] = {}
    for info in meta.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    out = []
    for name, size in sorted(need.items()):
        f = dcp_dir / name
        if not f.is_file() or f.stat().st_size < size:
            out.append(f"dcp/{name}")
    return out


def require_every_shard(ctx: DistContext, assembled: Path, name: str) -> None:
    """Before rank 0 publishes the checkpoint assembled in `assembled` as `name`: every rank's shard must be in it
    as rank 0 sees it. Raises IncompleteCheckpointError on every rank (nothing published) otherwise."""
    missing = agree(ctx, lambda: missing_shards(assembled))
    if missing:
        raise IncompleteCheckpointError(
            f"checkpoint {name} not published: {', '.join(missing)} missing from {assembled} as rank 0 sees it "
            "(each rank writes its own shard there): the ranks do not share run.output_dir; set it to a path "
            "on a filesystem every node mounts"
        )


def agreed_checkpoint(ctx: DistContext, find: Callable[[], Path | None]) -> Path | None:
    """The checkpoint to resume from, chosen by rank 0 (`find()` there: e.g. the one `latest` names) and checked
    on every rank before anything changes: each must see it whole. Raises on every rank (IncompleteCheckpointError
    naming the checkpoint and the missing shard, SharedFilesystemError naming the ranks that cannot see it)."""
    path = agree(ctx, find)
    if path is None:
        return None
    mine = missing_shards(path) if path.is_dir() else None  # None: this rank does not see the folder
    views = ctx.all_gather_object((mine, socket.gethostname()))
    blind = [r for r, (m, _) in enumerate(views) if m is None]
    if blind:
        raise SharedFilesystemError(
            f"cannot resume: rank(s) {_who(views, blind)} do not see the checkpoint {path} that rank 0 resumes "
            "from: run.output_dir must be one filesystem every node mounts at that path"
        )
    for r, (missing, _) in enumerate(views):
        if missing:
            raise IncompleteCheckpointError(
                f"cannot resume from {path}: shard {', '.join(missing)} is missing"
                + (f" (as rank {r} sees it)" if ctx.world_size > 1 else "")
                + ": the checkpoint is incomplete (a rank's shard was written elsewhere, or a file was removed). "
                "Nothing was changed: point checkpoints/latest at an earlier whole step-N, or start over with "
                "--overwrite"
            )
    return path


def check_every_rank_sees(ctx: DistContext, path: Path, what: str, needs: str = "config.json") -> None:
    """Every rank must see `path`/`needs` (rank 0 wrote it): e.g. the KL reference's sft/. Raises
    SharedFilesystemError on every rank, naming the ranks that do not."""
    views = ctx.all_gather_object(((Path(path) / needs).is_file(), socket.gethostname()))
    blind = [r for r, (ok, _) in enumerate(views) if not ok]
    if blind and len(blind) < len(views):
        raise SharedFilesystemError(
            f"rank(s) {_who(views, blind)} do not see {what} {path} (no {needs} there) that rank 0 reads: "
            "run.output_dir must be one filesystem every node mounts at that path"
        )
