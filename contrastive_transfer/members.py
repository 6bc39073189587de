"""An image stored as a member of a tar shard, read by its offset (contrastive_transfer/shards.py).

A ``Member`` is the path string ``SHARD/NAME`` (what a message shows, what a list of bad files
holds) that also carries where the member's bytes lie in the shard. Everything that reads an image
by its path (``contrastive_transfer.images``) reads a Member from its shard instead, so that the
datasets, samplers and data backends need not know whether a sample is a file or a member.
"""

from __future__ import annotations

import os

from contrastive_transfer.untrusted import KINDS, UnsafeFileError, open_untrusted

__all__ = ["Member", "read_member"]


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


def read_member(member: Member, kind: str = "image") -> bytes:
    """The member's bytes, the shard opened through the gate; UnsafeFileError (one line naming the
    shard and the member) when the member is above ``kind``'s cap or the shard no longer holds it
    (a shard truncated or replaced since it was indexed)."""
    cap = KINDS[kind].cap
    if member.size > cap:
        raise UnsafeFileError(
            f"{member}: member of {member.size} bytes, above the {cap >> 20} MiB limit for {KINDS[kind].what}",
            f"member of {member.size} bytes, above the limit for {KINDS[kind].what}",
        )
    with open_untrusted(member.shard, "shard") as f:
        end = os.fstat(f.fileno()).st_size
        if member.offset < 0 or member.offset + member.size > end:
            reason = (
                f"lies beyond the shard's {end} bytes (bytes {member.offset} to {member.offset + member.size}): "
                "the shard changed since it was indexed"
            )
            raise UnsafeFileError(f"{member}: {reason}", reason)
        f.seek(member.offset)
        return f.read(member.size)
