"""A rank maps a host range from several threads before pinning it (trainer.device.host_pages):
every page of the range mapped, as the kernel reports it (``/proc/self/smaps``)."""

from __future__ import annotations

import itertools
import mmap
import os
from collections.abc import Iterator

import numpy as np
import pytest
from _smaps import containing, mapping_kib

from trainer.device import host_pages

PAGE = mmap.PAGESIZE


@pytest.fixture
def memfd_map() -> Iterator[tuple[int, mmap.mmap]]:
    """A shared mapping of a 23-page memfd, nothing backed or mapped yet."""
    fd = os.memfd_create("host-pages")
    os.ftruncate(fd, 23 * PAGE)
    mapping = mmap.mmap(fd, 23 * PAGE, flags=mmap.MAP_SHARED)
    yield fd, mapping
    mapping.close()
    os.close(fd)


def address_of(mapping: mmap.mmap) -> int:
    return int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)


@pytest.mark.parametrize("nbytes", [1, 3 * PAGE, 23 * PAGE, 23 * PAGE + 5])
def test_chunks_tile_the_range_in_address_order(nbytes: int) -> None:
    tiles = host_pages.chunks(nbytes, 3 * PAGE)
    assert tiles[0][0] == 0 and sum(size for _, size in tiles) == nbytes
    assert all(offset + size == after for (offset, size), (after, _) in
               itertools.pairwise(tiles))
    assert all(0 < size <= 3 * PAGE for _, size in tiles)


def test_populate_maps_every_page_from_several_threads(
        memfd_map: tuple[int, mmap.mmap]) -> None:
    fd, mapping = memfd_map
    address = address_of(mapping)
    assert mapping_kib("self", containing(address))["Rss"] == 0
    # 8 chunks of 3 pages, the last one 2, for 3 threads: no multiple of either
    assert host_pages.populate(address, 23 * PAGE, threads=3, chunk_nbytes=3 * PAGE)
    assert mapping_kib("self", containing(address))["Rss"] * 1024 == 23 * PAGE
    assert os.fstat(fd).st_blocks * 512 == 23 * PAGE
    assert bytes(mapping[:16]) == bytes(16)  # mapped, not written


def test_populate_of_part_of_a_range_maps_only_that_part(
        memfd_map: tuple[int, mmap.mmap]) -> None:
    _fd, mapping = memfd_map
    address = address_of(mapping)
    assert host_pages.populate(address + 4 * PAGE, 7 * PAGE, threads=2, chunk_nbytes=2 * PAGE)
    assert mapping_kib("self", containing(address))["Rss"] * 1024 == 7 * PAGE


def test_populate_of_a_read_only_mapping_is_refused_without_raising(
        memfd_map: tuple[int, mmap.mmap]) -> None:
    fd, _mapping = memfd_map
    read_only = mmap.mmap(fd, 23 * PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        address = address_of(read_only)
        assert not host_pages.populate(address, 23 * PAGE, threads=2, chunk_nbytes=4 * PAGE)
        assert os.fstat(fd).st_blocks == 0
    finally:
        read_only.close()
