"""The prefill worker as a Ray actor: `ray.remote(**resources)(PrefillWorkerActor)`.

The service is imported when the actor is built, in the worker's process: the
controller, which only names this class, never imports torch (a second off every
pool's start-up)."""

from worker_runtime.host import WorkerActor


class PrefillWorkerActor(WorkerActor):
    """Starts a prefill worker's gRPC server on a free port of its node; `start()` returns it."""

    @staticmethod
    def service(config):
        from prefill_worker.service import PrefillWorker

        return PrefillWorker(config)
