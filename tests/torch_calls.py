"""Which torch calls a piece of code makes, for tests of code that runs beside the training
thread.

Every torch op called from Python lets go of the GIL, and a thread that lets go of it while
another one runs Python waits to get it back: on a worker's exchange thread each such call
is a hand-over between it and the training thread. `Calls` records the torch calls made
under it; `HELD` names those that keep the GIL (attribute reads, numpy views, a slice, a
tensor that is contiguous already).
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

HELD = frozenset({
    "getset_descriptor.__get__",  # .device, .dtype, .shape, .requires_grad
    "TensorBase.numpy",
    "TensorBase.dim",
    "TensorBase.contiguous",  # returns the tensor itself when it is contiguous
    "TensorBase.__getitem__",
})


class Calls(TorchFunctionMode):
    """Records the qualified name of every torch call made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.made.append(getattr(func, "__qualname__", str(func)))
        return func(*args, **(kwargs or {}))

    def releasing(self) -> list[str]:
        """The calls made that let go of the GIL."""
        return [name for name in self.made if name not in HELD]
