"""The decode worker as a Ray actor: `ray.remote(**resources)(DecodeWorkerActor)`.

The service is imported when the actor is built, in the worker's process: the
controller, which only names this class, never imports torch (a second off every
pool's start-up)."""

from worker_runtime.host import WorkerActor


class DecodeWorkerActor(WorkerActor):
    """Starts a decode worker's gRPC server on a free port of its node; `start()` returns it."""

    @staticmethod
    def service(config):
        from decode_worker.service import DecodeWorker

        return DecodeWorker(config)
