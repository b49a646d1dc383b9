"""Collectives between ranks: the process group, the ``Collectives`` wrapper the engine uses,
agreement on a value across ranks, and DeepSpeed's ``deepspeed.comm`` face.

Imports ``device`` only.
"""
