"""How much device memory the running gradient sums of an accumulation window may take.

Keeping a window's running sum on the compute device saves a D2H, an H2D and an add per
micro-batch (``DaemonBackend._sum_on_device``), but the sums are memory the user never
budgeted: ``stage3_max_live_parameters`` bounds the gathered parameters, nothing else
bounds the activations. A fixed share of the free memory ignores both: with fp32 sums,
parameters held across micro-batches and a long sequence, the second micro-batch's
forward runs out of memory where the first did not (the strict twin at 8 MiB did).

On a device of bounded memory (a GPU; the strict twin given a capacity) the room is
measured instead:

- the first accumulation window keeps no sum on the device; at its end the device's
  peak is what everything but the sums needs (gathered and held parameters,
  activations, recomputation, the reduction's buffers, the step);
- the sums then get what that peak leaves of the capacity less a margin
  (``HEADROOM_FRACTION``), as long as they live;
- a later window whose peak goes further into the margin than any before (longer
  sequences, more parameters held) takes its overshoot out of the room.

The room is decided for whole windows: a sum is only kept from a window's first
micro-batch on (``DaemonBackend._sum_on_device``), so it always holds the whole window.
The device's peak is read, never reset: a user's ``torch.cuda.max_memory_allocated``
means what it always meant. The host (no bound) keeps the old fixed share.
"""

from __future__ import annotations

import torch

from trainer.device.compute import device_memory, free_memory_nbytes

UNBOUNDED_ROOM_FRACTION = 2
"""Where no device budget can be measured (the twin without a capacity), the sums may
take 1/2 of what the device reports free when the backend starts."""
TWIN_DEVICE_NBYTES = 1 << 30
"""What the twin's "device" counts as free memory when no capacity was set for it."""
HEADROOM_FRACTION = 16
"""1/16 of the device is never planned for: the caching allocator's fragmentation, and a
micro-batch a little larger than the first window's (6% of capacity: 5 GB on an 80 GB
H100)."""


class SumRoom:
    """The bytes of running sums the backend may keep on ``device`` (``nbytes``)."""

    def __init__(self, device: torch.device, *, zero_copy: bool) -> None:
        self._device = device
        self._bounded = not zero_copy and device_memory(device) is not None
        self._overshoot = 0
        """How far the device's peak has gone past the plan (capacity less headroom)."""
        self._measured = False
        self.nbytes = 0
        """Bytes the running sums may take now (0 until the first window is measured on
        a bounded device; settable, as tests and tools do to force a path)."""
        if not zero_copy and not self._bounded:
            free = free_memory_nbytes(device)
            self.nbytes = (TWIN_DEVICE_NBYTES if free is None else free) // UNBOUNDED_ROOM_FRACTION

    def window_done(self) -> None:
        """An accumulation window ended (its optimizer step issued): plan the next."""
        memory = device_memory(self._device) if self._bounded else None
        if memory is None:
            return
        plan = memory.capacity - memory.capacity // HEADROOM_FRACTION
        if not self._measured:  # a window without device sums: its peak is the others'
            self._measured = True
            self.nbytes = max(0, plan - memory.peak)
        overshoot = max(0, memory.peak - plan)
        if overshoot > self._overshoot:
            self.nbytes = max(0, self.nbytes - (overshoot - self._overshoot))
            self._overshoot = overshoot

    def lend(self, sums_nbytes: int) -> int:
        """Give the room beyond ``sums_nbytes`` (what every sum of a window takes) to
        another use (Twin-Flow's device units, ``ratio: "auto"``); the bytes lent. Only
        a measured room is lent: a fixed share of an unbounded device is no measure."""
        if not self._measured:
            return 0
        spare = max(0, self.nbytes - sums_nbytes)
        self.nbytes -= spare
        return spare
