"""The wire codec: messages with bulk fields (`protos.frames`, re-exported here), and arrays
to and from raw bytes.

This is the one place that knows how arrays are laid out on the wire. Both ends use it.
Arrays are raw little-endian, row-major bytes; `tensor_from_bytes` views them without copying.
Views over received buffers are read-only: nothing in pstrain writes through them.

Tensors become bytes and back through numpy views, not torch ops: a torch op lets go of the
GIL, and on a worker's exchange thread every such hand-over makes it and the training thread
wait for each other. Only bfloat16, which numpy lacks, takes one op (it travels as its int16
bits).
"""

from __future__ import annotations

import warnings
from typing import cast

import numpy as np
import torch

from protos import pstrain_pb2 as pb
from protos.frames import (
    Frame,
    Payload,
    Received,
    WireError,
    decode,
    encode,
)

# torch warns on every view of an immutable buffer; the views made here are only read.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                        category=UserWarning)

__all__ = [
    "FLOAT_DTYPES",
    "Frame",
    "Payload",
    "Received",
    "WireError",
    "decode",
    "dtype_from_wire",
    "dtype_name",
    "dtype_to_wire",
    "encode",
    "keys_bytes",
    "keys_from_bytes",
    "tensor_bytes",
    "tensor_from_bytes",
]


_TO_TORCH: dict[int, torch.dtype] = {
    pb.FLOAT32: torch.float32,
    pb.FLOAT64: torch.float64,
    pb.FLOAT16: torch.float16,
    pb.BFLOAT16: torch.bfloat16,
    pb.INT64: torch.int64,
}
_TO_WIRE: dict[torch.dtype, int] = {v: k for k, v in _TO_TORCH.items()}
# What numpy holds each wire dtype as; bfloat16 as its bits.
_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype("<f4"),
    torch.float64: np.dtype("<f8"),
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<i2"),
    torch.int64: np.dtype("<i8"),
}

FLOAT_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16}
)


def dtype_from_wire(code: int) -> torch.dtype:
    """The torch dtype of a wire DType; WireError for an unknown or unset code."""
    try:
        return _TO_TORCH[code]
    except KeyError:
        raise WireError(
            f"unknown dtype code {code}; expected one of "
            f"{sorted(pb.DType.Name(c) for c in _TO_TORCH)}"
        ) from None


def _cannot_travel(dtype: torch.dtype) -> WireError:
    return WireError(f"dtype {dtype} cannot travel; use one of {sorted(str(d) for d in _TO_WIRE)}")


def dtype_to_wire(dtype: torch.dtype) -> pb.DType:
    """The wire DType of a torch dtype; WireError for dtypes the wire does not carry."""
    try:
        return cast(pb.DType, _TO_WIRE[dtype])
    except KeyError:
        raise _cannot_travel(dtype) from None


def _held(dtype: torch.dtype) -> np.dtype:
    """How numpy holds a wire dtype's elements; WireError for dtypes the wire does not carry."""
    try:
        return _NUMPY[dtype]
    except KeyError:
        raise _cannot_travel(dtype) from None


def dtype_name(code: int) -> str:
    """A readable name of a wire DType code, for messages."""
    return str(_TO_TORCH[code]).removeprefix("torch.") if code in _TO_TORCH else f"code {code}"


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor of a wire dtype, without copying when it is already
    contiguous. Makes no torch op but for bfloat16 (see the module's docstring)."""
    if tensor.device.type != "cpu":
        raise WireError(f"tensor is on {tensor.device}; copy it to host memory first")
    _held(tensor.dtype)  # refuses dtypes that do not travel
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.detach().view(torch.int16)
    array = np.ascontiguousarray(tensor.numpy(force=True))
    return array.reshape(-1).view(np.uint8).data


def tensor_from_bytes(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A read-only tensor of a wire dtype viewing `buf`; WireError if the byte count does not
    fit the shape. Makes no torch op but for bfloat16."""
    numel = 1
    for dim in shape:
        if dim < 0:
            raise WireError(f"negative dimension in shape {list(shape)}")
        numel *= dim
    itemsize = dtype.itemsize
    if buf.nbytes != numel * itemsize:
        raise WireError(
            f"payload is {buf.nbytes} bytes but shape {list(shape)} of {dtype} needs "
            f"{numel * itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    tensor = torch.from_numpy(np.frombuffer(buf, dtype=_held(dtype)).reshape(shape))
    return tensor.view(dtype) if dtype == torch.bfloat16 else tensor


def keys_from_bytes(buf: memoryview) -> np.ndarray:
    """int64 keys viewing `buf`; WireError unless its length is a multiple of 8."""
    if buf.nbytes % 8:
        raise WireError(f"keys payload is {buf.nbytes} bytes, not a multiple of 8 (int64 keys)")
    return np.frombuffer(buf, dtype="<i8")


def keys_bytes(keys: np.ndarray) -> memoryview:
    """The raw bytes of an int64 key array, without copying when it is contiguous."""
    return np.ascontiguousarray(keys, dtype=np.int64).data
