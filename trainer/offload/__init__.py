"""Where a rank's training state lives: the ``StateBackend`` interface with its in-process
backend, the daemon backend (units, leases, the optimizer-step queue, daemon copies), and
Twin-Flow's split between the two (``split``).

Imports ``device``, ``dist``, ``client`` and, from ``offloadd``, only the contract and
``ops.embedded``.
"""
