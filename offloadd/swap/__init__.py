"""The NVMe tier: swap space and files, manifests and crash-consistent flushes, retention of
ended jobs' files, the IO priority gate and the O_DIRECT IO engine, and the per-job tier that
moves shards between the arena and the disk.

Imports ``memory`` and the contract; never ``compute``, ``gpu``, ``service`` or ``ops``.
"""
