"""The daemon as clients see it: the unix-socket server, one session per rank, jobs and their
sliced batches, owners, per-uid limits, job lifecycle, daemon-driven device copies, /metrics.

Imports every layer below (``memory``, ``swap``, ``compute``, ``gpu``); never ``ops``.
"""
