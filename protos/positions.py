"""Where a worker is in its data: what a checkpoint records per worker, so a resumed job
carries each rank on from its next sample (part of the wire contract: workers send it with
each iteration's end, servers keep it and hand it back on join).

On the wire and in checkpoints a position is UTF-8 JSON: {"epoch": E, "batch": B,
"state": S}, where `batch` counts the batches of epoch E already trained and `state` is
opaque text a script may add (a sampler's seed and offset, say). Servers keep the bytes as
they came, without reading them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

# The most a position may take: a server keeps one per worker per recent iteration.
MAX_POSITION_BYTES: Final = 16 * 1024


class PositionError(ValueError):
    """A data position that cannot be sent or read back (the message says why)."""


@dataclass(frozen=True)
class DataPosition:
    """`batch` batches of epoch `epoch` are trained (0 and 0: nothing yet); `state` is the
    script's own text, returned as it was given."""

    epoch: int = 0
    batch: int = 0
    state: str = ""

    def __post_init__(self) -> None:
        for name, value in (("epoch", self.epoch), ("batch", self.batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PositionError(f"a data position's {name} must be an int >= 0, "
                                    f"got {value!r}")
        if not isinstance(self.state, str):
            raise PositionError(f"a data position's state must be text (str), got "
                                f"{type(self.state).__name__}; encode it, e.g. as JSON")

    def encode(self) -> bytes:
        data = json.dumps({"epoch": self.epoch, "batch": self.batch, "state": self.state},
                          separators=(",", ":")).encode()
        if len(data) > MAX_POSITION_BYTES:
            raise PositionError(
                f"the data position takes {len(data)} bytes encoded, over the limit of "
                f"{MAX_POSITION_BYTES}: keep a sampler's state small (a seed and a count)")
        return data

    @classmethod
    def decode(cls, data: bytes) -> DataPosition | None:
        """The position `encode` wrote; None for b"" (no position was kept)."""
        if not data:
            return None
        try:
            fields = json.loads(data)
            return cls(int(fields["epoch"]), int(fields["batch"]), str(fields.get("state", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise PositionError(f"a kept data position cannot be read ({exc}): "
                                f"{data[:80]!r}") from exc
