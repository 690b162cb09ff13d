"""`python -m bench ...` is `tandem bench ...`."""
import sys

from bench.cli import main

sys.exit(main())
