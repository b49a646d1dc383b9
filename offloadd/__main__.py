"""``python -m offloadd``: the ``offloadd`` command line (``offloadd.ops.cli``)."""

from offloadd.ops.cli import main

raise SystemExit(main())
