"""The prefill worker as a Ray actor: `ray.remote(**resources)(PrefillWorkerActor)`."""

from engine.worker_host import WorkerActor


class PrefillWorkerActor(WorkerActor):
    """Starts a prefill worker's gRPC server on a free port of its node; `start()` returns it."""
