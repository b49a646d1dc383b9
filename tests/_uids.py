"""Acting as another local user in a forked child (the tests that attack as a stranger)."""

from __future__ import annotations

import os


def become(uid: int) -> None:
    """Drop this (forked, root) process to ``uid``: no supplementary groups, gid = uid."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
