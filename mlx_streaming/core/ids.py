"""The ids a layer call carries: their type, and how many a decode step holds.

Expert and slot ids go to MLX's gather matmuls as uint32, their own index type, so they
cast nothing (int32 ids cost an AsType per projection: three ops per layer call).
``DECODE_IDS`` bounds a decode step's routed ids (tokens x top-k, with room): the
buffers that carry them to the device are this size, and calls up to it take the
paths made for a few ids (Python lists on the host, the device path on CUDA).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

SLOT_IDS = mx.uint32
SLOT_IDS_NP = np.uint32  # the same type in numpy
DECODE_IDS = 64
