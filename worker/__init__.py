"""The worker side of pstrain: the client, the job context and the PyTorch modules."""

from protos.positions import DataPosition, PositionError
from worker.context import WorkerContext, init

__all__ = ["DataPosition", "PositionError", "WorkerContext", "init"]
