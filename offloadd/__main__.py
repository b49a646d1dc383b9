from offloadd.ops.cli import main

raise SystemExit(main())
