"""A run of a flattened tensor as rectangular boxes (pure: integers only).

ZeRO keeps each parameter as a run ``[start, stop)`` of its flattened elements
(a rank's slice of a flat bucket cuts parameters anywhere). A checkpoint
stores each parameter in its own shape, as DCP chunks: rectangular boxes given
by ``offsets`` and ``sizes``. A run of a row-major tensor splits into at most
``2 * ndim - 1`` boxes, each a contiguous run itself::

    shape (4, 5), run [7, 18):       row 1 cols 2-4   -> box (1, 2) size (1, 3)
                                     rows 2           -> box (2, 0) size (1, 5)
                                     row 3 cols 0-2   -> box (3, 0) size (1, 3)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Box", "run_boxes"]


@dataclass(frozen=True)
class Box:
    """Elements ``[flat_start, flat_start + numel)`` of the flattened tensor, which
    form the box at ``offsets`` of size ``sizes`` in the tensor's shape."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _prefixed(row: int, boxes: list[Box], stride: int) -> list[Box]:
    """``boxes`` of one row's sub-tensor, as boxes of the whole tensor."""
    return [Box((row, *b.offsets), (1, *b.sizes), row * stride + b.flat_start) for b in boxes]


def run_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """The boxes covering elements ``[start, stop)`` of a tensor of ``shape``, in order."""
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"run [{start}, {stop}) is not inside a tensor of {numel} elements")
    if start == stop:
        return []
    if not shape:
        return [Box((), (), 0)]
    inner_shape = shape[1:]
    stride = math.prod(inner_shape)
    boxes: list[Box] = []
    if start % stride:  # a partial first row
        row = start // stride
        end = min(stop, (row + 1) * stride)
        inner = run_boxes(inner_shape, start - row * stride, end - row * stride)
        boxes += _prefixed(row, inner, stride)
        start = end
    rows = (stop - start) // stride
    if rows:
        zeros = (0,) * len(inner_shape)
        boxes.append(Box((start // stride, *zeros), (rows, *inner_shape), start))
        start += rows * stride
    if start < stop:  # a partial last row
        row = start // stride
        inner = run_boxes(inner_shape, 0, stop - row * stride)
        boxes += _prefixed(row, inner, stride)
    return boxes
