"""`python -m decode_worker`: one decode worker as a plain process (for debugging)."""

import sys

from engine.worker_host import main

sys.exit(main("decode"))
