"""The decode worker as a Ray actor: `ray.remote(**resources)(DecodeWorkerActor)`."""

from engine.worker_host import WorkerActor


class DecodeWorkerActor(WorkerActor):
    """Starts a decode worker's gRPC server on a free port of its node; `start()` returns it."""
