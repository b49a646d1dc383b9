"""The arena and what lives in it: the shared-memory arena and its allocator, the shard table
(residency, versions, leases), each rank's learned access trace and the eviction order it drives,
and the node's memory figures that bound the arenas (``node``, which ranks read too).

Imports the contract (``offloadd.protocol``, ``errors``, ``config``) and nothing above it.
"""
