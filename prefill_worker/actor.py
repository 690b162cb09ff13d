"""The prefill worker as a Ray actor: `ray.remote(**resources)(PrefillWorkerActor)`."""

from prefill_worker.service import PrefillWorker
from worker_runtime.host import WorkerActor


class PrefillWorkerActor(WorkerActor):
    """Starts a prefill worker's gRPC server on a free port of its node; `start()` returns it."""

    service = PrefillWorker
