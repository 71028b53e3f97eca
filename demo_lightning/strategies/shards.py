"""Per-rank checkpoint shards: each rank's own training state in a file of its own, beside Lightning's checkpoint.

Layout of a checkpoint ``<ckpt>`` written by :class:`~demo_lightning.strategies.CommunicationStrategy`
on W ranks::

    <ckpt>                      Lightning's file, written by rank 0 alone (weights, rank 0's optimizer
                                state, loops, callbacks); per optimizer under "demo_lightning" only
                                the layout: {"layout": "shards", "version": 1, "world_size": W,
                                "skipped_steps": n, "shards": "<name of ckpt>.shards"}
    <ckpt>.shards/rank0.pt      rank 0's own state   } one torch.save file per rank, written by that
    ...                                              } rank (no rank ever holds another rank's state):
    <ckpt>.shards/rank<W-1>.pt  rank W-1's own state } DeMo exchange state; under DES-LOC also its
                                                       optimizer state dict, parameters, buffers and
                                                       schedule position

A shard is ``{"format": SHARD_FORMAT, "version": 1, "rank": r, "world_size": W, <stamp>,
"optimizers": [entry or None per optimizer position]}``: tensors and primitives only, so
``torch.load(weights_only=True)`` reads it. ``rank``, ``world_size`` and the stamp (the Trainer's
``global_step`` and ``epoch``; under Fabric ``optimizer_step`` and ``save``, the strategy's counts of
optimizer steps and saves, equal on every rank) tie it to the main file: a shard left over from another save (one interrupted before every rank
wrote its shard) is refused on load instead of being used.

Writes are atomic on local filesystems: ``rank<r>.pt.tmp`` is written and fsynced, then renamed over
``rank<r>.pt``, so a killed save leaves the previous shard (or none) under the final name, never a
half-written one. On remote filesystems (fsspec URLs) the shard is uploaded in one write, which object
stores make visible whole.

Moving or copying a checkpoint means moving its ``.shards`` directory with it: the shards are looked
up at ``<path>.shards``, then (a symbolic link such as ``ModelCheckpoint(save_last="link")``'s
``last.ckpt``) at ``<link target>.shards``, then at the directory name recorded in the main file, in
the main file's directory.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol, get_filesystem
from lightning.fabric.utilities.types import _PATH

__all__ = [
    "SHARDS_LAYOUT",
    "SHARD_FORMAT",
    "SHARD_SUFFIX",
    "CheckpointShardError",
    "ShardReader",
    "remove_shard",
    "shard_dir",
    "shard_dir_name",
    "shard_path",
    "write_shard",
]

SHARDS_LAYOUT = "shards"
"""``"layout"`` of a main checkpoint's ``"demo_lightning"`` record whose per-rank state lies in shard files."""
SHARD_FORMAT = "demo_lightning/rank-shard"
SHARD_VERSION = 1
SHARD_SUFFIX = ".shards"


class CheckpointShardError(RuntimeError):
    """A rank's checkpoint shard is missing, unreadable, or written by another save.

    The message names the checkpoint, the rank, the shard file and the fix (copy the ``.shards``
    directory beside the checkpoint, or resume with only the weights).
    """


def shard_dir(checkpoint_path: _PATH) -> str:
    """``<checkpoint_path>.shards``: the directory holding every rank's shard of that checkpoint."""
    return f"{os.fspath(checkpoint_path)}{SHARD_SUFFIX}"


def shard_dir_name(checkpoint_path: _PATH) -> str:
    """The shard directory's own name (what the main file records), ``<name of the checkpoint>.shards``."""
    return os.path.basename(shard_dir(checkpoint_path))


def shard_path(checkpoint_path: _PATH, rank: int) -> str:
    """``<checkpoint_path>.shards/rank<rank>.pt``."""
    return _join(shard_dir(checkpoint_path), f"rank{rank}.pt")


def _join(directory: str, name: str) -> str:
    return os.path.join(directory, name) if _is_local_file_protocol(directory) else f"{directory.rstrip('/')}/{name}"


def write_shard(checkpoint_path: _PATH, rank: int, shard: Mapping[str, Any]) -> str:
    """Write ``shard`` to ``<checkpoint_path>.shards/rank<rank>.pt`` atomically; return that path.

    Local filesystems: written to ``rank<rank>.pt.tmp`` (fsynced), then renamed over the final name,
    so readers never see a partial file. Remote (fsspec) paths: one upload. Errors of the filesystem
    (no space, no permission) propagate unchanged; the final name then still holds the previous shard.
    """
    path = shard_path(checkpoint_path, rank)
    if _is_local_file_protocol(path):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            torch.save(dict(shard), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path
    fs = get_filesystem(path)
    fs.makedirs(shard_dir(checkpoint_path), exist_ok=True)
    buffer = io.BytesIO()
    torch.save(dict(shard), buffer)
    with fs.open(path, "wb") as f:
        f.write(buffer.getvalue())
    return path


def remove_shard(checkpoint_path: _PATH, rank: int) -> None:
    """Remove this rank's shard (and its leftover ``.tmp``) of ``checkpoint_path``, then the
    ``.shards`` directory if it is empty. Nothing else is touched: files of other ranks or of the
    user keep the directory. Missing files are fine; no symbolic link is followed.

    Every rank calls it for its own shard, with no barrier: whichever rank removes the last shard
    finds the directory empty and removes it; the others' attempts fail quietly.
    """
    path = shard_path(checkpoint_path, rank)
    directory = shard_dir(checkpoint_path)
    if not _is_local_file_protocol(path):
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path)
        return
    if os.path.islink(directory) or not os.path.isdir(directory):
        return
    for name in (path, path + ".tmp"):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)
    except OSError:  # not empty (another rank's shard, a user's file) or already removed by another rank
        pass


def _fix(checkpoint_path: str, recorded: Optional[str]) -> str:
    here = shard_dir_name(checkpoint_path)
    saved = f"{recorded!r} (its name when saved)" if recorded and recorded != here else repr(here)
    return (
        f"copy the checkpoint's shard directory {saved} next to {checkpoint_path!r} as {here!r}, with every rank's "
        f"rank<r>.pt in it; or resume with only the weights: load them (LightningModule.load_from_checkpoint, or "
        "model.load_state_dict(torch.load(path)['state_dict'])) and fit without ckpt_path, which restarts the per-rank "
        "state (DeMo momenta, DES-LOC replicas and schedule) from scratch"
    )


def _describe(stamp: Mapping[str, Any]) -> str:
    """``rank 1 of 2 at global step 3, epoch 0``."""
    rest = ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in stamp.items() if key not in ("rank", "world_size"))
    return f"rank {stamp['rank']} of {stamp['world_size']} at {rest}"


class ShardReader:
    """Reads the shards of one checkpoint, each at most once.

    Args:
        checkpoint_path: the main checkpoint file (as passed to ``Strategy.load_checkpoint``).
        record: the main file's ``"demo_lightning"`` record (``layout == "shards"``).
        stamp: what ties a shard to its main file, the same keys in both: the Trainer's
            ``{"global_step", "epoch"}``, Fabric's ``{"optimizer_step", "save"}``; a shard whose
            stamp differs was written by another save.
    """

    def __init__(self, checkpoint_path: _PATH, record: Mapping[str, Any], stamp: Mapping[str, Any]) -> None:
        self.checkpoint_path = os.fspath(checkpoint_path)
        self.recorded: Optional[str] = record.get("shards")
        self.world_size = int(record["world_size"])
        self.stamp = dict(stamp)
        self._cache: dict[int, dict[str, Any]] = {}

    def directory(self) -> str:
        """The first of ``<path>.shards``, ``<link target>.shards`` and the recorded name that is a directory
        (``<path>.shards`` if none is)."""
        path = self.checkpoint_path
        candidates = [shard_dir(path)]
        if _is_local_file_protocol(path):
            real = os.path.realpath(path)
            if real != os.path.abspath(path):
                candidates.append(shard_dir(real))
            if self.recorded:
                candidates.append(os.path.join(os.path.dirname(os.path.abspath(path)), self.recorded))
            for candidate in candidates:
                if os.path.isdir(candidate):
                    return candidate
        return candidates[0]

    def path(self, rank: int) -> str:
        return _join(self.directory(), f"rank{rank}.pt")

    def entry(self, rank: int, position: int, reader_rank: int, why: str = "") -> dict[str, Any]:
        """Rank ``rank``'s saved state of optimizer ``position``, for ``reader_rank``.

        Raises:
            CheckpointShardError: the shard is missing, unreadable, not a shard, from another save
                (rank, world size, global step or epoch differ from the main file's), or has no entry
                for the optimizer; the message names the files, the ranks and the fix.
        """
        shard = self._read(rank, reader_rank, why)
        entries = shard["optimizers"]
        if not (0 <= position < len(entries)) or not isinstance(entries[position], dict):
            raise self._error(rank, reader_rank, why, f"holds no state for optimizer {position} ({len(entries)} saved)")
        return entries[position]

    def _read(self, rank: int, reader_rank: int, why: str) -> dict[str, Any]:
        if rank in self._cache:
            return self._cache[rank]
        path = self.path(rank)
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise self._error(rank, reader_rank, why, "is missing")
        try:
            with fs.open(path, "rb") as f:
                shard = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as error:  # truncated, damaged, not a torch file
            raise self._error(rank, reader_rank, why, f"cannot be read ({type(error).__name__}: {error})") from error
        if not isinstance(shard, dict) or shard.get("format") != SHARD_FORMAT or not isinstance(shard.get("optimizers"), list):
            raise self._error(rank, reader_rank, why, "is not a demo_lightning checkpoint shard")
        if int(shard.get("version", 0)) > SHARD_VERSION:
            raise self._error(
                rank, reader_rank, why,
                f"has shard format version {shard['version']}, newer than this demo_lightning reads ({SHARD_VERSION}): upgrade demo_lightning",
            )
        want = {"rank": rank, "world_size": self.world_size, **self.stamp}
        got = {k: shard.get(k) for k in want}
        if got != want:
            raise self._error(
                rank, reader_rank, why,
                f"was written by another save ({_describe(got)}; the checkpoint is {_describe(want)}): a save interrupted "
                "before every rank wrote its shard, or shards copied from another checkpoint",
            )
        self._cache[rank] = shard
        return shard

    def _error(self, rank: int, reader_rank: int, why: str, what: str) -> CheckpointShardError:
        whose = "its own shard" if rank == reader_rank else f"rank {rank}'s shard"
        return CheckpointShardError(
            f"rank {reader_rank} cannot restore its per-rank state from {self.checkpoint_path!r}: {whose} {self.path(rank)!r} "
            f"{what}{why}. The checkpoint keeps each rank's own state (DeMo momenta; DES-LOC optimizer state, replica "
            f"and schedule) in one file per rank of the {self.world_size} that saved it, beside the checkpoint. Fix: "
            f"{_fix(self.checkpoint_path, self.recorded)}"
        )
