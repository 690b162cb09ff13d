"""`python -m decode_worker`: one decode worker as a plain process (for debugging)."""

import sys

from decode_worker.service import DecodeWorker
from worker_runtime.config import Role
from worker_runtime.host import main

sys.exit(main(Role.DECODE, DecodeWorker))
