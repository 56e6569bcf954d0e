"""Deterministic initial values for sparse embedding rows.

A sparse table creates a row the first time a key is touched. Its initial value must not
depend on which shard holds the key, which batch brought it, or in what order rows were
created, so that a restarted or resharded run sees the same rows. So every element is a pure
function of ``(seed, key, column)``: a counter-based hash (splitmix64), computed vectorised
in numpy uint64 arithmetic, turned into a uniform or normal variate.

The scheme, which is a compatibility contract (changing it changes every table's initial
state; ``tests/ps/test_initializers.py`` pins reference values):

* ``seed_hash = mix(seed + G)``, where ``mix`` is splitmix64's finaliser, ``G`` its golden
  gamma 0x9E3779B97F4A7C15, and all arithmetic is modulo 2**64; seeds and keys are taken
  modulo 2**64, so a negative key is its two's complement whatever its integer dtype.
* ``key_hash = mix(mix(key + G) ^ seed_hash)``.
* Columns come in pairs: ``z = mix(key_hash + (p + 1) * G)`` serves columns ``2p`` and
  ``2p + 1``, the low 32 bits of ``z`` for the even column and the high 32 bits for the odd
  one. A column's value therefore never depends on the table's ``dim``.
* Uniform: the top 24 bits of a 32-bit half, ``u = bits / 2**24`` in [0, 1), then
  ``a + (b - a) * u``. Normal: Box-Muller on the pair, ``u1`` from the low half shifted
  into (0, 1] (so the log is finite) and ``u2`` from the high half;
  ``r = sqrt(-2 ln u1)``, the even column gets ``a + b * r cos(2 pi u2)`` and the odd one
  ``a + b * r sin(2 pi u2)``.

Values are computed in float32 and then cast, so a table gets the same initial values
(up to the cast's rounding) whatever its dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ps.errors import InvalidArgumentError

__all__ = ["KINDS", "InitSpec", "init_rows"]

KINDS: tuple[str, ...] = ("zeros", "constant", "uniform", "normal")
"""Initialiser kinds ``InitSpec.kind`` accepts."""

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB

# Elements hashed per chunk. With a few scratch arrays of this many uint64s (256 KiB each)
# the ten-odd passes of the hash run out of cache instead of streaming a 32 MiB array
# through memory ten times; measured about 2x faster at 64k rows of 64.
_CHUNK_ELEMENTS = 1 << 15

_UNIT_24 = 2.0**-24  # the spacing of 24-bit fractions: float32 represents them exactly


@dataclass(frozen=True)
class InitSpec:
    """How a table initialises new rows. Validated on construction.

    ``kind`` is one of ``KINDS``:

    * ``"zeros"``: every element 0 (``a`` and ``b`` are ignored);
    * ``"constant"``: every element ``a`` (``b`` is ignored);
    * ``"uniform"``: uniform on [a, b), needs ``a < b`` (the bound holds in float32; a cast
      to float16 or bfloat16 may round a value up to b);
    * ``"normal"``: normal with mean ``a`` and standard deviation ``b``, needs ``b > 0``.
    """

    kind: str = "uniform"
    a: float = -0.05
    b: float = 0.05

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(
                f"InitSpec.kind must be one of {list(KINDS)}, got {self.kind!r}"
            )
        for field, value in (("a", self.a), ("b", self.b)):
            # bool is an int subclass; True as a bound is a caller bug, not 1.0.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidArgumentError(
                    f"InitSpec.{field} must be a real number, got {value!r} of type "
                    f"{type(value).__name__}"
                )
            if not math.isfinite(value):
                raise InvalidArgumentError(f"InitSpec.{field} must be finite, got {value!r}")
        if self.kind == "uniform" and not self.a < self.b:
            raise InvalidArgumentError(
                f"a uniform InitSpec needs a < b, got a={self.a!r} and b={self.b!r}; "
                "a is the low end and b the high end"
            )
        if self.kind == "normal" and not self.b > 0:
            raise InvalidArgumentError(
                f"a normal InitSpec needs a standard deviation b > 0, got b={self.b!r}; "
                "a is the mean and b the standard deviation"
            )


def init_rows(
    keys: npt.NDArray[np.integer],
    dim: int,
    spec: InitSpec,
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Return the initial values of the rows for ``keys``, shape ``[len(keys), dim]``.

    Row ``i`` depends only on ``(seed, keys[i], spec)``, and its column ``j`` only on
    ``(seed, keys[i], j, spec)``: splitting the keys into batches, reordering them, or
    growing ``dim`` leaves every existing value unchanged. ``keys`` is a 1-D array of any
    integer dtype; a key is taken modulo 2**64, so -1 as int32 and as int64 give the same
    row. ``dtype`` is float32 (the default), float16, bfloat16 or float64.

    Raises InvalidArgumentError for bad keys, dim, seed or dtype. Does not block; pure and
    thread-safe (it allocates its own output and scratch memory).
    """
    if not isinstance(keys, np.ndarray) or keys.ndim != 1 or keys.dtype.kind not in "iu":
        shown = (
            f"a {keys.ndim}-D {keys.dtype} array" if isinstance(keys, np.ndarray) else repr(keys)
        )
        raise InvalidArgumentError(f"keys must be a 1-D numpy array of integers, got {shown}")
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
        raise InvalidArgumentError(f"dim must be a positive int, got {dim!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"seed must be an int, got {seed!r}")
    if dtype not in _DTYPES:
        raise InvalidArgumentError(
            f"dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype!r}"
        )
    n = keys.shape[0]
    if spec.kind == "zeros":
        return torch.zeros((n, dim), dtype=dtype)
    if spec.kind == "constant":
        return torch.full((n, dim), spec.a, dtype=dtype)

    pairs = (dim + 1) // 2
    out = np.empty((n, 2 * pairs), dtype=np.float32)
    # The hash relies on uint64 arithmetic wrapping modulo 2**64; numpy may flag that as
    # overflow (it does for scalars), which here is the intended behaviour, not an error.
    with np.errstate(over="ignore"):
        key_hash = _key_hashes(keys, seed)
        if spec.kind == "uniform":
            _fill_uniform(out, key_hash, spec.a, spec.b)
        else:
            _fill_normal(out, key_hash, spec.a, spec.b)
    values = torch.from_numpy(out)
    if 2 * pairs != dim:
        values = values[:, :dim]
    return values.to(dtype).contiguous()


def _mix_scalar(z: int) -> int:
    """splitmix64's finaliser on a Python int (exact, so no numpy overflow semantics)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def _mix_inplace(z: npt.NDArray[np.uint64], scratch: npt.NDArray[np.uint64]) -> None:
    """splitmix64's finaliser on ``z`` in place; ``scratch`` is a buffer shaped like ``z``."""
    np.right_shift(z, np.uint64(30), out=scratch)
    np.bitwise_xor(z, scratch, out=z)
    np.multiply(z, np.uint64(_MIX1), out=z)
    np.right_shift(z, np.uint64(27), out=scratch)
    np.bitwise_xor(z, scratch, out=z)
    np.multiply(z, np.uint64(_MIX2), out=z)
    np.right_shift(z, np.uint64(31), out=scratch)
    np.bitwise_xor(z, scratch, out=z)


def _key_hashes(keys: npt.NDArray[np.integer], seed: int) -> npt.NDArray[np.uint64]:
    seed_hash = _mix_scalar((seed + _GOLDEN) & _MASK64)
    # astype wraps negative keys to their two's complement, the same for every int width.
    key_hash = keys.astype(np.uint64)
    np.add(key_hash, np.uint64(_GOLDEN), out=key_hash)
    scratch = np.empty_like(key_hash)
    _mix_inplace(key_hash, scratch)
    np.bitwise_xor(key_hash, np.uint64(seed_hash), out=key_hash)
    _mix_inplace(key_hash, scratch)
    return key_hash


def _hashed_halves(
    key_hash: npt.NDArray[np.uint64],
    offsets: npt.NDArray[np.uint64],
    z: npt.NDArray[np.uint64],
    scratch: npt.NDArray[np.uint64],
) -> npt.NDArray[np.uint32]:
    """Hash a chunk of keys against every column pair; return the top 24 bits of each half.

    The result is ``[len(key_hash), 2 * pairs]`` uint32 in [0, 2**24): column ``2p`` from
    the low half of pair ``p``'s hash, column ``2p + 1`` from the high half.
    """
    np.add(key_hash[:, None], offsets[None, :], out=z)
    _mix_inplace(z, scratch)
    # Fixed little-endian halves keep the values the same on big-endian machines; on
    # little-endian ones both calls are free views.
    halves = z.astype("<u8", copy=False).view("<u4")
    top_bits: npt.NDArray[np.uint32] = np.right_shift(
        halves, np.uint32(8), out=scratch.view(np.uint32)
    )
    return top_bits


def _chunks(n: int, pairs: int) -> list[slice]:
    size = max(1, _CHUNK_ELEMENTS // pairs)
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _pair_offsets(pairs: int) -> npt.NDArray[np.uint64]:
    offsets = np.arange(1, pairs + 1, dtype=np.uint64)
    np.multiply(offsets, np.uint64(_GOLDEN), out=offsets)
    return offsets


def _fill_uniform(
    out: npt.NDArray[np.float32], key_hash: npt.NDArray[np.uint64], low: float, high: float
) -> None:
    n, width = out.shape
    pairs = width // 2
    offsets = _pair_offsets(pairs)
    scale = np.float32((high - low) * _UNIT_24)
    shift = np.float32(low)
    # a + (b - a) * u can round up to b in float32; the largest float below b keeps the
    # documented half-open range.
    top = np.nextafter(np.float32(high), np.float32(low))
    z_buf = np.empty((min(n, max(1, _CHUNK_ELEMENTS // pairs)), pairs), dtype=np.uint64)
    scratch_buf = np.empty_like(z_buf)
    for rows in _chunks(n, pairs):
        count = rows.stop - rows.start
        z, scratch = z_buf[:count], scratch_buf[:count]
        bits = _hashed_halves(key_hash[rows], offsets, z, scratch)
        chunk = out[rows]
        # int32 -> float32 is exact below 2**24 and has a fast SIMD conversion.
        np.multiply(bits.view(np.int32), scale, out=chunk, dtype=np.float32, casting="unsafe")
        np.add(chunk, shift, out=chunk)
        np.minimum(chunk, top, out=chunk)


def _fill_normal(
    out: npt.NDArray[np.float32], key_hash: npt.NDArray[np.uint64], mean: float, std: float
) -> None:
    n, width = out.shape
    pairs = width // 2
    offsets = _pair_offsets(pairs)
    unit = np.float32(_UNIT_24)
    two_pi_unit = np.float32(2.0 * math.pi * _UNIT_24)
    z_buf = np.empty((min(n, max(1, _CHUNK_ELEMENTS // pairs)), pairs), dtype=np.uint64)
    scratch_buf = np.empty_like(z_buf)
    for rows in _chunks(n, pairs):
        count = rows.stop - rows.start
        z, scratch = z_buf[:count], scratch_buf[:count]
        bits = _hashed_halves(key_hash[rows], offsets, z, scratch).view(np.int32)
        bits = bits.reshape(count, pairs, 2)
        # u1 = (bits + 1) / 2**24 lies in (0, 1], so log(u1) is finite and <= 0.
        radius = np.add(bits[:, :, 0], 1, dtype=np.float32)
        np.multiply(radius, unit, out=radius)
        np.log(radius, out=radius)
        np.multiply(radius, np.float32(-2.0), out=radius)
        np.sqrt(radius, out=radius)
        np.multiply(radius, np.float32(std), out=radius)
        angle = np.multiply(bits[:, :, 1], two_pi_unit, dtype=np.float32, casting="unsafe")
        chunk = out[rows].reshape(count, pairs, 2)
        even, odd = chunk[:, :, 0], chunk[:, :, 1]
        np.cos(angle, out=even)
        np.sin(angle, out=odd)
        np.multiply(even, radius, out=even)
        np.multiply(odd, radius, out=odd)
        np.add(chunk, np.float32(mean), out=chunk)
