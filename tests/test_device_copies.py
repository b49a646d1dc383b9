"""Daemon-driven device copies on the CPU twin (offloadd.service.device_copies,
trainer.offload.daemon_copies).

A real daemon process copies between the job's arena and a rank's staging
slots (a memfd on the twin) on its own worker thread: the protocol (stage_in,
stage_out, slot_done) and its ordering rules against raw clients, the
fallback to rank copies with its logged reason and metric, and training
through the daemon path against plain torch.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import time
import warnings
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from test_daemon_metrics import scrape, value

from offloadd import protocol as p
from offloadd.errors import InvalidRequestError, SlotBusyError, UnknownShardError
from offloadd.ops.embedded import PrivateDaemon
from offloadd.protocol import TWIN_FAILED, TwinEvents, twin_staging_nbytes
from trainer.client import OffloadClient
from trainer.device.copy_engine import TwinCopyEngine
from trainer.offload.daemon_copies import (
    TWIN_GPU_UUID_ENV,
    DaemonCopies,
    open_daemon_copies,
)

pytestmark = pytest.mark.usefixtures("strict_device_twin")

SLOT_NBYTES = 4096
NUM_SLOTS = 3
SESSIONS = "offloadd_device_copies_sessions_total"


class TwinSlots:
    """A raw rank's twin staging: a memfd it lends the daemon by staging_open, ending with
    the events area (offloadd.gpu.cuda.TwinEvents) where the rank records "consumed" and waits
    for "filled"."""

    def __init__(self, num_slots: int = NUM_SLOTS, slot_nbytes: int = SLOT_NBYTES,
                 seal: bool = True) -> None:
        nbytes = twin_staging_nbytes(num_slots, slot_nbytes)
        self.fd = os.memfd_create("test-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, nbytes)
        if seal:
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.map = mmap.mmap(self.fd, nbytes)
        self.events = TwinEvents(memoryview(self.map), num_slots, slot_nbytes)
        self.num_slots, self.slot_nbytes = num_slots, slot_nbytes

    def open_request(self, **fields: object) -> p.StagingOpen:
        request = p.StagingOpen(0, "twin", "twin-0", self.num_slots, self.slot_nbytes,
                                staging_fd=self.fd)
        for key, field_value in fields.items():
            setattr(request, key, field_value)
        return request

    def slot(self, index: int, nbytes: int) -> bytes:
        start = index * self.slot_nbytes
        return bytes(self.map[start : start + nbytes])

    def write(self, index: int, data: bytes) -> None:
        start = index * self.slot_nbytes
        self.map[start : start + len(data)] = data

    def filled(self, reply: p.Reply | None) -> p.Staged:
        """Wait for the copy a stage_in's reply names (the reply comes at issue)."""
        assert isinstance(reply, p.Staged), reply
        word = self.events.wait(2 * reply.slot + 1, reply.seq, "filled")
        assert not word & TWIN_FAILED, f"copy {reply.seq} into slot {reply.slot} failed"
        return reply

    def stage_in(self, client: OffloadClient, shard_id: str, index: int) -> p.Staged:
        return self.filled(client.request(p.StageIn(0, shard_id, index)))

    def slot_done(self, client: OffloadClient, index: int) -> None:
        self.events.record_consumed(index)
        client.request(p.SlotDone(0, index))

    def stage_out(self, client: OffloadClient, shard_id: str, index: int,
                  data: bytes) -> None:
        self.write(index, data)
        self.events.record_consumed(index)
        client.request(p.StageOut(0, shard_id, index, len(data)))

    def close(self) -> None:
        self.events.release()
        self.map.close()
        os.close(self.fd)


@pytest.fixture
def slots() -> Iterator[TwinSlots]:
    staging = TwinSlots()
    yield staging
    staging.close()


def _opened(connect, slots: TwinSlots) -> OffloadClient:
    client = connect()
    reply = client.request(slots.open_request())
    assert isinstance(reply, p.StagingOk)
    assert (reply.path, reply.reason) == ("daemon", "")
    return client


def test_stage_in_and_out_move_shard_bytes(daemon: PrivateDaemon, connect,
                                           slots: TwinSlots) -> None:
    copied = "offloadd_device_copies_bytes_total"
    before = scrape(daemon)
    client = _opened(connect, slots)
    payload = os.urandom(1000)
    client.put("w", payload)
    slots.stage_in(client, "w", 1)
    assert slots.slot(1, 1000) == payload
    slots.slot_done(client, 1)

    gradient = os.urandom(1000)
    slots.stage_out(client, "w", 2, gradient)
    assert client.get("w") == gradient  # committed once the copy completed
    with client.acquire("w", "r") as lease:
        assert lease.version == 2
    after = scrape(daemon)
    for direction in ("h2d", "d2h"):
        assert value(after, copied, direction=direction) == \
            value(before, copied, direction=direction) + 1000


def test_slot_reused_before_consumer_event_fails(connect, slots: TwinSlots) -> None:
    """The twin catches a slot filled again before the rank reported consuming it."""
    client = _opened(connect, slots)
    client.put_many({"a": b"a" * 64, "b": b"b" * 64})
    slots.stage_in(client, "a", 0)
    with pytest.raises(SlotBusyError, match="consumer event"):
        client.request(p.StageIn(0, "b", 0))
    assert slots.slot(0, 64) == b"a" * 64  # the refused copy never touched the slot
    with pytest.raises(SlotBusyError):  # a staged slot is not drained either
        client.request(p.StageOut(0, "b", 0, 64))
    slots.slot_done(client, 0)
    with pytest.raises(SlotBusyError):  # consumed twice
        client.request(p.SlotDone(0, 0))
    slots.stage_in(client, "b", 0)
    assert slots.slot(0, 64) == b"b" * 64


def test_two_copies_in_flight_on_one_slot_fail(connect, slots: TwinSlots) -> None:
    """Pipelined requests: the second stage_in on a slot whose copy is running is refused."""
    client = _opened(connect, slots)
    client.put("a", b"x" * 2048)
    first = client.request_async(p.StageIn(0, "a", 0))
    second = client.request_async(p.StageIn(0, "a", 0))
    first.wait()
    with pytest.raises(SlotBusyError):
        second.wait()


def test_stage_in_replies_at_issue_and_the_copy_waits_at_use(connect, slots: TwinSlots) -> None:
    """Depth > 1: each stage_in is answered when its copy is issued, with the sequence number
    of the slot's "filled" event the rank waits for at use. A copy into a slot whose
    consumer event the rank has not recorded yet waits on the daemon's stream, so the
    replies of it and of the copies queued behind it come while none has completed."""
    client = _opened(connect, slots)
    values = {name: name.encode() * 64 for name in "abcd"}
    client.put_many(values)
    first = slots.stage_in(client, "a", 0)
    client.request(p.SlotDone(0, 0))  # announced; the rank records "consumed" only below
    replies = [client.request(p.StageIn(0, name, slot))
               for name, slot in (("b", 0), ("c", 1), ("d", 2))]
    assert [(reply.slot, reply.seq) for reply in replies if isinstance(reply, p.Staged)] \
        == [(0, first.seq + 1), (1, 1), (2, 1)]
    time.sleep(0.2)  # the daemon's stream stays held at the consumer event meanwhile
    assert [slots.events.filled(slot) for slot in range(NUM_SLOTS)] == [first.seq, 0, 0]
    assert slots.slot(0, 64) == values["a"]  # the rank still reads it: not overwritten
    slots.events.record_consumed(0)
    for reply, name in zip(replies, "bcd", strict=True):
        assert slots.slot(slots.filled(reply).slot, 64) == values[name]


def test_stage_out_waits_for_a_copy_still_reading_the_shard(connect, slots: TwinSlots) -> None:
    """A rank reads a gradient in (stage_in, answered at issue), adds to it on the device and
    writes it back (stage_out) before the read's copy ran: the write waits for that copy's
    read lease instead of failing with a lease conflict, and the shard ends up holding the
    written bytes while the slot read in holds the old ones."""
    client = _opened(connect, slots)
    old, new = b"o" * 64, b"n" * 64
    client.put_many({"grad": old, "other": b"x" * 64})
    slots.stage_in(client, "other", 0)
    client.request(p.SlotDone(0, 0))  # the rank records "consumed" only below
    read = client.request(p.StageIn(0, "grad", 0))  # answered at issue, held on the stream
    slots.write(1, new)
    slots.events.record_consumed(1)
    write = client.request_async(p.StageOut(0, "grad", 1, len(new)))
    time.sleep(0.2)
    slots.events.record_consumed(0)  # the read copy runs, then the write
    write.wait()
    assert slots.slot(slots.filled(read).slot, 64) == old
    assert client.get("grad") == new


def test_staging_open_pins_off_the_event_loop(monkeypatch) -> None:
    """Opening a copier (cudaHostRegister of the whole arena: seconds for a large one) runs
    off the daemon's loop, which keeps serving other sessions meanwhile."""
    import offloadd.service.device_copies as device_copies

    pin_s = 0.3

    def slow_open_copier(**_fields: object) -> SimpleNamespace:
        time.sleep(pin_s)  # as hostRegister of a large arena
        return SimpleNamespace(kind="twin", num_slots=NUM_SLOTS, slot_nbytes=SLOT_NBYTES)

    monkeypatch.setattr(device_copies, "open_copier", slow_open_copier)
    job = SimpleNamespace(name="job", arena=SimpleNamespace(view=memoryview(b""),
                                                            pin_shortage=lambda: ""))
    session = SimpleNamespace(job=job, rank=0, peer_pid=0, peer_uid=0, staging=None,
                              staging_opening=False, closed=False)
    request = p.StagingOpen(0, "twin", "twin-0", NUM_SLOTS, SLOT_NBYTES, staging_fd=3)

    async def open_while_serving() -> tuple[p.StagingOk, int]:
        service = device_copies.DeviceCopiesService()
        opening = asyncio.ensure_future(service.open(session, request))  # type: ignore[arg-type]
        ticks = 0
        while not opening.done():  # another session's requests, answered every 10 ms
            await asyncio.sleep(0.01)
            ticks += 1
        return opening.result(), ticks

    reply, ticks = asyncio.run(open_while_serving())
    assert (reply.path, reply.reason) == ("daemon", "")
    assert ticks >= pin_s / 0.01 / 3, ticks  # blocked on the loop it would be 1
    assert session.staging is not None


def test_bad_stage_requests_get_typed_errors_and_the_daemon_serves_on(
        connect, slots: TwinSlots) -> None:
    client = _opened(connect, slots)
    other = connect(rank=1, world_size=2)
    other.put("theirs", b"t" * 16)
    client.put("mine", b"m" * 16)
    with pytest.raises(UnknownShardError):  # another rank's shard is not ours to stage
        client.request(p.StageIn(0, "theirs", 0))
    with pytest.raises(UnknownShardError):
        client.request(p.StageOut(0, "nope", 0, 16))
    with pytest.raises(InvalidRequestError, match="out of range"):
        client.request(p.StageIn(0, "mine", NUM_SLOTS))
    with pytest.raises(InvalidRequestError, match="out of range"):
        client.request(p.SlotDone(0, -1))
    with pytest.raises(InvalidRequestError, match="16 B"):  # size must match the shard
        client.request(p.StageOut(0, "mine", 0, 8))
    client.put("big", b"b" * (SLOT_NBYTES + 1))
    with pytest.raises(InvalidRequestError, match="as large as the largest shard"):
        client.request(p.StageIn(0, "big", 0))
    with pytest.raises(InvalidRequestError, match="already sent"):
        client.request(slots.open_request())
    unopened = connect(rank=1, world_size=2)
    with pytest.raises(InvalidRequestError, match="staging_open"):
        unopened.request(p.StageIn(0, "theirs", 0))
    # Every slot is still usable and the daemon serves both clients.
    for slot in range(NUM_SLOTS):
        slots.stage_in(client, "mine", slot)
        assert slots.slot(slot, 16) == b"m" * 16
    assert other.get("theirs") == b"t" * 16


def test_staging_open_refusals_are_counted(daemon: PrivateDaemon, connect,
                                           slots: TwinSlots) -> None:
    before = scrape(daemon)
    client = connect()
    cases = [
        (slots.open_request(device_uuid="GPU-00000000-0000-0000-0000-000000000000"),
         "gpu_not_visible"),
        (slots.open_request(kind="cuda", device_uuid="GPU-1"), "no_cupy"),
        (slots.open_request(staging_fd=987654), "ipc_refused"),
        (slots.open_request(rank_reason="expandable_segments"), "expandable_segments"),
    ]
    for request, reason in cases:
        reply = client.request(request)
        assert isinstance(reply, p.StagingOk)
        assert (reply.path, reply.reason) == ("rank", reason)
    with pytest.raises(InvalidRequestError, match="slots"):
        client.request(slots.open_request(num_slots=0))
    after = scrape(daemon)
    for _, reason in cases:
        assert value(after, SESSIONS, path="rank", reason=reason) == \
            value(before, SESSIONS, path="rank", reason=reason) + 1
    with open(daemon.log_path) as log:
        assert "event=device_copies_fallback" in log.read()


def test_rank_side_copies_round_trip(connect) -> None:
    """trainer.offload.daemon_copies over the real daemon: read, prefetch, write, slots."""
    client = connect()
    engine = TwinCopyEngine()
    copies, reason = open_daemon_copies(client, engine, num_slots=2, slot_nbytes=256,
                                        local_rank=0, arena_pinned="pinned")
    try:
        assert reason == "" and isinstance(copies, DaemonCopies)
        values = {f"u{i}": torch.randn(16) for i in range(4)}
        client.put_many(values)
        copies.prefetch(list(values))  # one slot stays free for reads that missed
        assert copies.staged_ahead == 1
        out = torch.empty(16)
        assert copies.read_into("u0", out)
        assert torch.equal(out, values["u0"])
        for name in ("u1", "u2", "u3"):
            assert not copies.read_into(name, out)
            assert torch.equal(out, values[name])
        copies.write_from("u1", values["u1"] * 2)
        copies.read_into("u1", out)  # waits for the write's commit first
        assert torch.equal(out, values["u1"] * 2)
        copies.drain()
        assert len(copies._free) == 2
    finally:
        if copies is not None:
            copies.close()
        engine.close()


def test_rank_without_device_copy_engine_falls_back(connect) -> None:
    from trainer.device.copy_engine import InlineCopyEngine

    client = connect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        copies, reason = open_daemon_copies(client, InlineCopyEngine(), num_slots=2,
                                            slot_nbytes=256, local_rank=0,
                                            arena_pinned="not_attempted")
    assert copies is None and reason == "host_compute"
    assert [str(w.message) for w in caught if "device_copies" in str(w.message)] == [
        'offloadd.device_copies "daemon" is not possible here (host_compute: compute reads '
        "the arena directly (no device copy engine): there is nothing for the daemon to "
        "copy); training on with rank copies"]


def test_twin_uuid_env_names_the_device(monkeypatch, connect) -> None:
    monkeypatch.setenv(TWIN_GPU_UUID_ENV, "GPU-not-here")
    engine = TwinCopyEngine()
    try:
        with pytest.warns(RuntimeWarning, match="gpu_not_visible"):
            copies, reason = open_daemon_copies(connect(), engine, num_slots=2,
                                                slot_nbytes=64, local_rank=0,
                                                arena_pinned="pinned")
        assert copies is None and reason == "gpu_not_visible"
    finally:
        engine.close()


# ---------------------------------------------------------------------------
# training through the daemon path (2 gloo ranks, one real daemon)


def _zero(stage: int, device: str) -> dict[str, object]:
    zero: dict[str, object] = {"stage": stage, "offload_optimizer": {"device": device}}
    if stage == 3:
        zero["offload_param"] = {"device": device}
    return zero


def _train_cases(rank: int, world: int, device: str, cases: list[dict]) -> list[object]:
    """Rank body: each case in its own job on one shared daemon, with daemon copies."""
    import tempfile

    from _dist import make_batch, make_model, shared_daemon

    import trainer
    from trainer.state.checkpoint import consolidate_fp32_state_dict

    swap_dir = tempfile.mkdtemp(prefix="offloadd-swap-") if device == "nvme" else None
    results = []
    with shared_daemon(rank, swap_dir, arena_size=256 << 20) as socket_path:
        for index, config in enumerate(cases):
            config = {**config, "offloadd": {"socket": socket_path, "job": f"dc{device}{index}",
                                             "arena_size": 16 << 20,
                                             "device_copies": "daemon", "staging_slots": 3}}
            if swap_dir:
                for section in config["zero_optimization"].values():
                    if isinstance(section, dict):
                        section["nvme_path"] = swap_dir
            model = make_model(0)
            engine, _, _, _ = trainer.initialize(model=model,
                                                 model_parameters=model.parameters(),
                                                 config=config)
            try:
                for step in range(STEPS):
                    for micro in range(engine.gradient_accumulation_steps()):
                        batch = make_batch(step, micro, rank,
                                           engine.train_micro_batch_size_per_gpu())
                        loss = engine(*(t.to(engine.collectives.device) for t in batch))
                        engine.backward(loss)
                        engine.step()
                stats = engine.offload_stats()
                results.append((consolidate_fp32_state_dict(engine), stats))
            finally:
                engine.close()
    return results


STEPS = 5


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_daemon_copies_train_like_plain_torch(device: str) -> None:
    """Stages 2 and 3 with every parameter H2D and gradient D2H copied by the daemon."""
    from _dist import base_config, max_relative_error, reference_train, run_ranks

    cases = [base_config(zero_optimization=_zero(2, device)),
             base_config(zero_optimization=_zero(3, device), gradient_accumulation_steps=2)]
    results = run_ranks(_train_cases, 2, device, cases)[0]
    for config, (state, stats) in zip(cases, results, strict=True):
        assert stats["rank_copy_engine"] == "twin"
        assert (stats["rank_device_copies"], stats["rank_device_copies_reason"]) == ("daemon", "")
        error = max_relative_error(state, reference_train(config, STEPS, 2))
        assert error < 1e-5, (device, config["zero_optimization"], error)
    assert results[1][1]["rank_staged_ahead"] > 0  # stage 3 staged units ahead of use


def _train_fallback(rank: int, world: int, socket_path: str, config: dict) -> object:
    from _dist import engine_train

    config = {**config, "offloadd": {"socket": socket_path, "job": "fallback",
                                     "arena_size": 16 << 20, "device_copies": "daemon"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, _losses = engine_train(rank, world, config, STEPS)
    return state, [str(w.message) for w in caught if "device_copies" in str(w.message)]


def test_fallback_logs_one_reason_counts_it_and_trains_on_rank_copies(
        monkeypatch, daemon: PrivateDaemon) -> None:
    """The daemon cannot see the rank's GPU: one warning per rank, the metric, rank copies."""
    from _dist import base_config, max_relative_error, reference_train, run_ranks

    monkeypatch.setenv(TWIN_GPU_UUID_ENV, "GPU-00000000-0000-0000-0000-000000000000")
    before = value(scrape(daemon), SESSIONS, path="rank", reason="gpu_not_visible")
    config = base_config(zero_optimization=_zero(3, "cpu"))
    results = run_ranks(_train_fallback, 2, daemon.socket_path, config)
    for _state, messages in results:
        assert len(messages) == 1 and "(gpu_not_visible: " in messages[0], messages
    error = max_relative_error(results[0][0], reference_train(config, STEPS, 2))
    assert error < 1e-5
    after = value(scrape(daemon), SESSIONS, path="rank", reason="gpu_not_visible")
    assert after == before + 2  # one per rank


# ---------------------------------------------------------------------------
# the backend over the daemon path, and what every device-copying rank reports


def test_backend_reports_pinning_and_rank_path(daemon: PrivateDaemon, connect) -> None:
    from trainer.dist.collectives import Collectives
    from trainer.offload.daemon_backend import DaemonBackend

    pinned = "offloadd_arena_pinned_sessions_total"
    before = scrape(daemon)
    engines = [TwinCopyEngine(), TwinCopyEngine(memlock_nbytes=1)]  # the second cannot pin
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the refused pinning warns (tested elsewhere)
        backends = [DaemonBackend(connect(), collectives=Collectives(),
                                  copies=engine) for engine in engines]
    after = scrape(daemon)
    for backend in backends:
        backend.close()
    assert value(after, pinned, outcome="pinned") == value(before, pinned, outcome="pinned") + 1
    assert value(after, pinned, outcome="failed") == value(before, pinned, outcome="failed") + 1
    assert value(after, SESSIONS, path="rank", reason="configured") == \
        value(before, SESSIONS, path="rank", reason="configured") + 2


def test_backend_daemon_copies_accumulate_and_read(connect) -> None:
    """Gradients summed on the "device" and committed by the daemon's D2H; the buffer the
    reducer reuses at once does not leak into the shard."""
    from trainer.dist.collectives import Collectives
    from trainer.offload.backend import UnitSpec
    from trainer.offload.daemon_backend import DaemonBackend

    twin = TwinCopyEngine()
    backend = DaemonBackend(connect(), collectives=Collectives(), copies=twin,
                            device_copies="daemon", staging_slots=2)
    try:
        for unit in range(3):
            backend.register(UnitSpec(index=unit, part_numel=32, param_dtype=torch.float32),
                             torch.full((32,), float(unit)))
        grad = torch.full((32,), 2.0)
        norm = backend.accumulate_grad(1, grad, first=True, want_sq_norm=True)
        grad.fill_(99.0)  # the reducer reuses its buffer while the D2H may still run
        assert float(norm) == pytest.approx(32 * 4.0)
        backend.accumulate_grad(1, torch.ones(32), first=False, want_sq_norm=False)
        backend.wait_steps()  # the gradient's D2H holds a slot until its commit
        backend.prefetch_params([0, 1, 2])
        out = torch.empty(32)
        for unit in range(3):
            backend.read_params(unit, out)
            assert torch.equal(out, torch.full((32,), float(unit)))
        stats = backend.stats()
        assert stats["rank_device_copies"] == "daemon"
        assert stats["rank_staged_hits"] == 1  # two slots: one staged ahead, one kept free
        assert backend.client.get("u1.grad") == torch.full((32,), 3.0).numpy().tobytes()
    finally:
        backend.close()


def test_client_gone_during_a_copy_releases_its_lease(daemon: PrivateDaemon, connect) -> None:
    """A rank that dies with stage_in/stage_out in flight: the copies finish, their leases
    go back (a torn write publishes nothing), and the daemon serves the next rank."""
    nbytes = 4 << 20
    staging = TwinSlots(num_slots=2, slot_nbytes=nbytes)
    try:
        client = connect(arena_nbytes=32 << 20)
        client.put_many({"big": b"\x01" * nbytes, "out": b"\x02" * nbytes})
        assert isinstance(client.request(staging.open_request(num_slots=2)), p.StagingOk)
        staging.write(1, b"\x03" * nbytes)
        staging.events.record_consumed(1)
        client.request_async(p.StageIn(0, "big", 0))
        client.request_async(p.StageOut(0, "out", 1, nbytes))
        client.close()
        again = connect()
        for _ in range(10_000):  # until the daemon handled the disconnect and the copies
            try:
                with again.acquire_many(["big", "out"], "w"):
                    break
            except Exception as error:  # LeaseConflictError while a copy still holds one
                assert "lease" in str(error), error
        else:
            raise AssertionError("the copies' leases never came back")
        assert again.get("out") in (b"\x02" * nbytes, b"\x03" * nbytes)  # old or new, whole
        assert again.get("big") == b"\x01" * nbytes
    finally:
        staging.close()


def test_cuda_ipc_handle_is_unwrapped_from_torchs_layout() -> None:
    """torch's _share_cuda_ handle is [version][type][payload]; the daemon opens the payload."""
    from trainer.offload.daemon_copies import StagingUnavailable, cuda_ipc_mem_handle

    raw = bytes(range(64))
    assert cuda_ipc_mem_handle(raw) == raw  # torch before versioned handles
    for version in (2, 3):
        assert cuda_ipc_mem_handle(bytes([version]) + b"c" + raw) == raw
    with pytest.raises(StagingUnavailable) as expandable:
        cuda_ipc_mem_handle(bytes([3]) + b"e" + raw + b"more")
    assert expandable.value.reason == "expandable_segments"
    with pytest.raises(StagingUnavailable) as unknown:
        cuda_ipc_mem_handle(b"\x03x" + raw)
    assert unknown.value.reason == "ipc_refused"


def test_expandable_segments_is_a_rank_side_fallback_reason(monkeypatch) -> None:
    from trainer.offload.daemon_copies import StagingUnavailable, check_allocator_exportable

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64, expandable_segments:True")
    with pytest.raises(StagingUnavailable, match="unset it") as refused:
        check_allocator_exportable()
    assert refused.value.reason == "expandable_segments"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    check_allocator_exportable()


def test_staging_must_be_a_sealed_memfd_of_the_rank(daemon: PrivateDaemon, connect,
                                                    tmp_path) -> None:
    """The daemon maps what the rank names: an unsealed memfd (the rank could shrink it under
    the daemon's mapping) or a plain file is refused, and the daemon serves on."""
    client = connect()
    unsealed = TwinSlots(seal=False)
    with open(tmp_path / "plain", "wb+") as plain:
        plain.truncate(NUM_SLOTS * SLOT_NBYTES)
        try:
            for request, detail in (
                    (unsealed.open_request(), "not sealed against shrinking"),
                    (unsealed.open_request(staging_fd=plain.fileno()), "not a memfd")):
                reply = client.request(request)
                assert isinstance(reply, p.StagingOk)
                assert (reply.path, reply.reason) == ("rank", "ipc_refused")
                with open(daemon.log_path) as log:
                    assert detail in log.read()
        finally:
            unsealed.close()
    client.put("x", b"x")
    assert client.get("x") == b"x"


def test_find_device_prefers_the_pci_bus_id_over_a_truncated_uuid() -> None:
    """cupy hands the UUID's 16 bytes through a C string that stops at the first zero byte;
    the PCI bus id (nvidia-smi writes an 8-digit domain, CUDA a 4-digit one) still matches."""
    from offloadd.gpu.cuda import CopiesRefused, find_device, normalize_pci_bus_id

    uuid = bytes.fromhex("58e2a1000b3c4d5e8f9a0b1c2d3e4f50")
    runtime = SimpleNamespace(
        getDeviceCount=lambda: 2,
        getDeviceProperties=lambda index: {"uuid": uuid.split(b"\0")[0] if index else b"x"},
        deviceGetPCIBusId=lambda index: ["0000:17:00.0", "0000:18:00.0"][index])
    cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))
    dashed = "GPU-58e2a100-0b3c-4d5e-8f9a-0b1c2d3e4f50"
    assert normalize_pci_bus_id("00000000:18:00.0") == normalize_pci_bus_id("0000:18:00.0")
    assert find_device(cupy, dashed, "00000000:18:00.0") == 1
    assert find_device(cupy, dashed) == 1  # by UUID: the prefix cupy kept, then a zero byte
    with pytest.raises(CopiesRefused, match="not visible"):
        find_device(cupy, "GPU-58e2a1ff-0b3c-4d5e-8f9a-0b1c2d3e4f50")
    # The H100 of the first GPU run: its UUID holds a zero byte, cupy gave 6 bytes of 16.
    h100 = bytes.fromhex("a1681e1bb876e2a500076180ee4bf701")
    runtime.getDeviceProperties = lambda index: {"uuid": h100.split(b"\0")[0]}
    runtime.getDeviceCount = lambda: 1
    assert find_device(cupy, "a1681e1b-b876-e2a5-0007-6180ee4bf701") == 0
