"""`python -m dgxmm`: the same as the `dgxmm` command."""

from dgxmm.cli import main

raise SystemExit(main())
