"""What an operator runs: the ``offloadd`` command line, ``status`` / ``gc``, log setup, and
the private daemon a training job starts for itself (``embedded``, which the rank side uses).

May import every layer; nothing in the daemon imports it.
"""
