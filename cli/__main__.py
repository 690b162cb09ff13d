"""`python -m cli ...`: the `tandem` command without its console script."""

import sys

from cli.main import main

sys.exit(main())
