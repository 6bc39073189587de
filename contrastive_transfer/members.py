"""An image stored as a member of a tar shard, read by its offset (contrastive_transfer/shards.py).

A ``Member`` is the path string ``SHARD/NAME`` (what a message shows, what a list of bad files
holds) that also carries where the member's bytes lie in the shard. Everything that reads an image
by its path (``contrastive_transfer.images``) reads a Member from its shard instead, so that the
datasets, samplers and data backends need not know whether a sample is a file or a member.
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict

from contrastive_transfer.untrusted import KINDS, UnsafeFileError, open_untrusted

__all__ = ["Member", "read_member"]


def _max_open_shards() -> int:
    """A quarter of the process's descriptors (the rest for what it opens otherwise). A random
    epoch reads every shard at random: fewer kept than shards would reopen them all the time, so a
    soft limit below the hard one is raised to it first (as ``ulimit -n`` would; many clusters keep
    a soft limit of 1024 with a far higher hard one), up to 65536."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    wanted = 65536 if hard == infinity else min(hard, 65536)
    if soft != infinity and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):
            pass
    return 16384 if soft == infinity else max(16, soft // 4)


_MAX_OPEN: list[int] = []  # _max_open_shards(), computed at the first shard opened (no limit changed before)
_OPEN: OrderedDict[str, tuple[int, int]] = OrderedDict()  # shard path → (descriptor, size when opened)
_LOCK = threading.Lock()


class Member(str):
    """``SHARD/NAME`` with the member's data ``offset`` and ``size`` in the shard."""

    shard: str
    name: str
    offset: int
    size: int

    def __new__(cls, shard: str, name: str, offset: int, size: int) -> "Member":
        self = super().__new__(cls, f"{shard}/{name}")
        self.shard, self.name, self.offset, self.size = shard, name, int(offset), int(size)
        return self

    def __reduce__(self):  # to DataLoader workers and back (a bad member's path in a batch)
        return Member, (self.shard, self.name, self.offset, self.size)


def _open_shard(shard: str) -> tuple[int, int]:
    """(descriptor, size) of the shard, opened through the gate once per process and kept: an epoch
    then opens each shard once (at most ``_max_open_shards()`` are held; the least recently read is
    closed), where a folder opens every image. Reads use ``os.pread``, which moves no file offset,
    so DataLoader workers that inherit a descriptor by fork share it safely."""
    with _LOCK:
        if shard in _OPEN:
            _OPEN.move_to_end(shard)
            return _OPEN[shard]
        with open_untrusted(shard, "shard") as f:
            fd = os.dup(f.fileno())
        _OPEN[shard] = (fd, os.fstat(fd).st_size)
        if not _MAX_OPEN:
            _MAX_OPEN.append(_max_open_shards())
        while len(_OPEN) > _MAX_OPEN[0]:
            os.close(_OPEN.popitem(last=False)[1][0])
        return _OPEN[shard]


def forget(shards) -> None:
    """Close the kept descriptors of these shards: an index made now reads the files as they are
    now (a shard rewritten in place since is a new file)."""
    with _LOCK:
        for shard in shards:
            if shard in _OPEN:
                os.close(_OPEN.pop(shard)[0])


def read_member(member: Member, kind: str = "image") -> bytes:
    """The member's bytes, its shard opened through the gate; UnsafeFileError (one line naming the
    shard and the member) when the member is above ``kind``'s cap or the shard no longer holds it
    (a shard truncated or replaced since it was indexed)."""
    cap = KINDS[kind].cap
    if member.size > cap:
        raise UnsafeFileError(
            f"{member}: member of {member.size} bytes, above the {cap >> 20} MiB limit for {KINDS[kind].what}",
            f"member of {member.size} bytes, above the limit for {KINDS[kind].what}",
        )
    fd, end = _open_shard(member.shard)
    data = os.pread(fd, member.size, member.offset) if 0 <= member.offset <= end - member.size else b""
    if len(data) != member.size:
        reason = (
            f"lies beyond the shard's {end} bytes (bytes {member.offset} to {member.offset + member.size}): "
            "the shard changed since it was indexed"
        )
        raise UnsafeFileError(f"{member}: {reason}", reason)
    return data
