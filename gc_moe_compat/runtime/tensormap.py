"""TMA descriptors (``CUtensorMap``) for the SM90 kernels, encoded by the driver and passed by value.

A 2D byte tensor ``[rows, cols]`` (row-major) is described with a box of ``128 bytes x box_rows``: with 128-byte
swizzle for E4M3 tiles (the layout the kernels' WGMMA shared-memory descriptors expect), without swizzle for the
FP4 weight units that the register decoder reads with plain LDS. Out-of-range rows read as zero.
"""

from __future__ import annotations

import ctypes

import torch
from cuda.bindings import driver

from gc_moe_compat.runtime.cuda import call, init_driver

TensorMapArg = ctypes.c_ubyte * 128


def encode_2d(t: torch.Tensor, box_rows: int, box_cols: int = 128, swizzle: bool = True) -> TensorMapArg:
    """The tensor map of a contiguous 2D one-byte CUDA tensor ``t`` as a 128-byte kernel argument
    (``swizzle``: 128-byte swizzle, else none)."""
    if t.dim() != 2 or t.element_size() != 1 or not t.is_contiguous() or not t.is_cuda:
        raise ValueError(f"t: need a contiguous 2D one-byte CUDA tensor, got {t.dtype} {tuple(t.shape)} {t.device}")
    rows, cols = t.shape
    if cols % 16 or t.data_ptr() % 16:
        raise ValueError(f"t: rows must be 16-byte multiples and 16-byte aligned (TMA), got {cols} columns")
    if not (1 <= box_rows <= 256 and box_cols == 128):
        raise ValueError(f"box: rows in [1, 256] and 128 columns (128-byte swizzle), got {box_rows} x {box_cols}")
    init_driver()
    mode = (
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
        if swizzle
        else driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE
    )
    tmap = call(
        driver.cuTensorMapEncodeTiled,
        driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
        driver.cuuint32_t(2),
        t.data_ptr(),
        [driver.cuuint64_t(cols), driver.cuuint64_t(rows)],
        [driver.cuuint64_t(cols)],
        [driver.cuuint32_t(box_cols), driver.cuuint32_t(box_rows)],
        [driver.cuuint32_t(1), driver.cuuint32_t(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        mode,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    return TensorMapArg.from_buffer_copy(ctypes.string_at(tmap.getPtr(), 128))
