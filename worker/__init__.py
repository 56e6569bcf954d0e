"""The worker side of pstrain: the client, the job context and the PyTorch modules."""

from worker.context import WorkerContext, init

__all__ = ["WorkerContext", "init"]
