"""The blocking client against the real daemon: data path, list forms, lease semantics."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from offloadd.errors import (
    LeaseConflictError,
    NoSwapError,
    ShardExistsError,
    TornShardError,
    UnknownShardError,
)
from trainer.client import LeaseGroup, ReleasedLeaseError, ShardLease


def test_put_get_round_trips_bytes_arrays_and_tensors(connect) -> None:
    client = connect()
    payload = os.urandom(10_000)
    client.put("bytes", payload)
    assert client.get("bytes") == payload
    array = np.arange(1000, dtype=np.float32)
    client.put("array", array)
    tensor = torch.randn(33, 7, dtype=torch.bfloat16)
    client.put("tensor", tensor)
    assert np.array_equal(np.frombuffer(client.get("array"), np.float32), array)
    with client.acquire("tensor") as lease:
        assert lease.dtype == "bfloat16"
        assert torch.equal(lease.tensor().view(33, 7), tensor)
    client.put("empty", b"")
    assert client.get("empty") == b""


def test_put_again_overwrites_and_bumps_the_version(connect) -> None:
    client = connect()
    client.put("s", b"aaaa")
    with client.acquire("s") as first:
        version = first.version
    client.put("s", b"bbbb")
    with client.acquire("s") as second:
        assert bytes(second.view) == b"bbbb" and second.version == version + 1
    with pytest.raises(ShardExistsError):
        client.put("s", b"a different size")


def test_acquire_yields_a_zero_copy_view_of_the_shared_arena(connect, job: str) -> None:
    writer, reader = connect(job, rank=0), connect(job, rank=0)  # two sessions, one rank
    writer.alloc("z", 4096, "float32")
    with writer.acquire("z", "w") as lease:
        view = lease.tensor()
        assert view.dtype == torch.float32 and view.numel() == 1024
        # The view is the arena itself: its address lies inside the client's mapping.
        base = np.frombuffer(writer.arena.view, np.uint8).ctypes.data
        assert view.data_ptr() == base + lease.offset
        view.fill_(3.5)
    with reader.acquire("z") as seen:  # another mapping of the same memfd
        assert torch.all(seen.tensor() == 3.5)


def test_list_forms_alloc_acquire_put_drop(connect) -> None:
    client = connect()
    ids = [f"u{i}.param" for i in range(50)]
    client.alloc(ids, [64 * (i + 1) for i in range(50)], "uint8")
    group = client.acquire_many(ids, "w")
    assert isinstance(group, LeaseGroup) and len(group) == 50
    with group:
        for i, lease in enumerate(group):
            assert lease.nbytes == 64 * (i + 1)
            lease.view[:] = bytes([i]) * lease.nbytes
    offsets = [lease.offset for lease in group]
    assert len(set(offsets)) == 50 and all(o % 4096 == 0 for o in offsets)
    client.put_many({"a": b"1", "b": b"22"})
    with client.acquire_many(["a", "b", ids[7]]) as group:
        assert [bytes(lease.view) for lease in group] == [b"1", b"22", bytes([7]) * 512]
    client.prefetch(ids)  # accepted without a swap tier (everything is in the arena)
    client.drop([*ids, "a", "b"])
    stats = client.stats()
    assert stats["num_shards"] == 0 and stats["arena_used_nbytes"] == 0


def test_alloc_is_idempotent_for_the_same_size_and_dtype(connect) -> None:
    client = connect()
    client.alloc("s", 100, "float32")
    client.alloc("s", 100, "float32")
    with pytest.raises(ShardExistsError):
        client.alloc("s", 100, "int8")
    assert client.stats()["num_shards"] == 1


def test_flush_without_a_swap_dir_is_a_typed_error(connect) -> None:
    with pytest.raises(NoSwapError, match="--swap-dir"):
        connect().flush("tag")


def test_stats_report_the_session_and_the_node(connect, daemon, job: str) -> None:
    stats = connect(job, rank=0, world_size=1).stats()
    assert stats["job"] == job and stats["rank"] == 0
    assert stats["daemon_pid"] == daemon.pid and stats["swap"] is None
    assert stats["arena_locked"] in (True, False)


# -- lease semantics ------------------------------------------------------------------------


def test_a_write_lease_is_exclusive_and_read_leases_are_shared(connect, job: str) -> None:
    first, second = connect(job), connect(job)
    first.put("s", b"x")
    with first.acquire("s", "r"), second.acquire("s", "r"), pytest.raises(LeaseConflictError):
        second.acquire("s", "w")
    with first.acquire("s", "w"):
        for mode in ("r", "w"):
            with pytest.raises(LeaseConflictError):
                second.acquire("s", mode)
        with pytest.raises(LeaseConflictError):
            first.acquire("s", "r")  # also for the writer's own session
    with second.acquire("s", "w"):
        pass
    assert first.stats()["leased_nbytes"] == 0


def test_a_batch_with_one_conflict_takes_no_lease(connect, job: str) -> None:
    first, second = connect(job), connect(job)
    first.put_many({"a": b"1", "b": b"2"})
    with first.acquire("b", "w"):
        with pytest.raises(LeaseConflictError) as caught:
            second.acquire_many(["a", "b"], "r")
        assert caught.value.shard_ids == ["b"]
        assert second.stats()["leased_nbytes"] == 4096  # only first's "b"
    with pytest.raises(LeaseConflictError):
        second.acquire_many(["a", "a"], "w")  # a writer twice in one batch


def test_use_after_release_raises(connect) -> None:
    client = connect()
    client.put("s", b"abc")
    with client.acquire("s") as lease:
        assert bytes(lease.view) == b"abc"
    assert lease.released
    for use in (lambda: lease.view, lambda: lease.tensor(), lambda: lease.numpy()):
        with pytest.raises(ReleasedLeaseError, match="acquire it again"):
            use()
    lease.release()  # a second release is a no-op, not a daemon error
    group = client.acquire_many(["s"])
    group.release()
    with pytest.raises(ReleasedLeaseError):
        group[0].view  # noqa: B018


def test_release_on_exception_tears_the_shard_until_written_again(connect) -> None:
    # Issue 13, item 3: bytes half-written when the block raised are never
    # published: the version stays, reads are refused, a new write heals it.
    client = connect()
    client.put("s", b"v1")
    with client.acquire("s") as before:
        version = before.version
    with pytest.raises(RuntimeError, match="boom"), client.acquire("s", "w") as lease:
        lease.view[:] = b"v2"
        raise RuntimeError("boom")
    assert client.stats()["leased_nbytes"] == 0
    with pytest.raises(TornShardError, match="write it again"):
        client.get("s")
    with client.acquire("s", "w") as again:  # released: writable again
        assert again.version == version
        again.view[:] = b"v3"
    assert client.get("s") == b"v3"
    with pytest.raises(RuntimeError), client.acquire_many(["s"], "w"):
        raise RuntimeError("group")
    assert client.stats()["leased_nbytes"] == 0
    with pytest.raises(TornShardError):
        client.get("s")


def test_leases_are_released_when_the_client_closes(connect, job: str) -> None:
    holder, observer = connect(job), connect(job)
    holder.put("s", b"1")
    lease = holder.acquire("s", "w")
    assert isinstance(lease, ShardLease)
    holder.close()
    with pytest.raises(ReleasedLeaseError):
        lease.view  # noqa: B018  # the client's mapping is gone with it
    observer.stats()
    with observer.acquire("s", "w"):
        pass


def test_the_blocking_client_is_thread_safe(connect) -> None:
    client = connect()
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for round_ in range(50):
                payload = f"{index}:{round_:03d}".encode()
                client.put(f"t{index}", payload)
                assert client.get(f"t{index}") == payload
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    with pytest.raises(UnknownShardError):
        client.get("t4")
