"""Where a rank's tensors live and how bytes reach them: the compute device and its side
group, the copy engines (CUDA streams, inline, the timed twin), and the strict CPU device twin.

The lowest layer: imports nothing else of ``trainer`` and nothing of ``offloadd``.
"""
