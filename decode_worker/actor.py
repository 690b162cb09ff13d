"""The decode worker as a Ray actor: `ray.remote(**resources)(DecodeWorkerActor)`."""

from decode_worker.service import DecodeWorker
from worker_runtime.host import WorkerActor


class DecodeWorkerActor(WorkerActor):
    """Starts a decode worker's gRPC server on a free port of its node; `start()` returns it."""

    service = DecodeWorker
