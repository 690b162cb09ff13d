"""`python -m prefill_worker`: one prefill worker as a plain process (for debugging)."""

import sys

from engine.worker_host import main

sys.exit(main("prefill"))
