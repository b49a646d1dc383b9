"""Where a rank's training state lives: the ``StateBackend`` interface with its in-process
backend, and the daemon backend (units, leases, the optimizer-step queue, daemon copies).

Imports ``device``, ``dist``, ``client`` and, from ``offloadd``, only the contract and
``ops.embedded``.
"""
