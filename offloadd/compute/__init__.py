"""The optimizer step the daemon runs on arena memory: the native Adam kernels with their
torch reference, and the service that leases a unit's shards and runs them off the event loop.

Imports ``memory`` and the contract; what it needs of a job is ``optimizer``'s ``Job``
protocol.
"""
