"""`python -m prefill_worker`: one prefill worker as a plain process (for debugging)."""

import sys

from prefill_worker.service import PrefillWorker
from worker_runtime.config import Role
from worker_runtime.host import main

sys.exit(main(Role.PREFILL, PrefillWorker))
