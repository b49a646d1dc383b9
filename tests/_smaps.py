"""What the kernel says of one mapping of a process (``/proc/<pid>/smaps``): how much of
it is resident and how much locked, to check that memory is backed and mlock'ed for real."""

from __future__ import annotations

from collections.abc import Callable


def mapping_kib(pid: int | str, matches: Callable[[int, int, str], bool]) -> dict[str, int]:
    """The kB fields (Rss, Locked, ...) of the first mapping of ``pid`` for which
    ``matches(start, end, path)`` holds; AssertionError if none does."""
    fields: dict[str, int] | None = None
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head, _, rest = line.partition(" ")
            if "-" in head and not head.endswith(":"):  # a mapping's header line
                if fields is not None:
                    return fields
                start, end = (int(x, 16) for x in head.split("-"))
                path = rest.split(maxsplit=4)[4].strip() if len(rest.split()) > 4 else ""
                fields = {} if matches(start, end, path) else None
            elif fields is not None and rest.strip().endswith("kB"):
                fields[head.rstrip(":")] = int(rest.split()[0])
    if fields is None:
        raise AssertionError(f"no such mapping in /proc/{pid}/smaps")
    return fields


def containing(address: int) -> Callable[[int, int, str], bool]:
    """``matches`` for the mapping that holds ``address``."""
    return lambda start, end, _path: start <= address < end


def memfd_named(name: str) -> Callable[[int, int, str], bool]:
    """``matches`` for a mapping of the memfd called ``name`` (e.g. ``offloadd:job``)."""
    return lambda _start, _end, path: path.startswith(f"/memfd:{name} ")
