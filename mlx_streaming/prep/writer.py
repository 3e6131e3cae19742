"""Writing an expert directory's layer files: each written under a temporary name,
fsync'd and renamed, with a clear error when the disk fills up."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
from pathlib import Path

import numpy as np

from ..core.format import ExpertDirError, LayerLayout, record_checksum

BLOCK_BYTES = 64 << 20  # experts written per block, per layer


def write_layer_file(path: Path, source, layout: LayerLayout) -> list[str]:
    """Write one layer's records from ``source.rows(part, e0, e1)`` (uint8-viewable rows
    of experts ``[e0, e1)`` of one part); returns the records' checksums."""
    tmp = path.with_name(path.name + ".partial")
    per_block = max(1, BLOCK_BYTES // layout.stride)
    sums = []
    try:
        with open(tmp, "wb") as f:
            for e0 in range(0, layout.num_experts, per_block):
                e1 = min(layout.num_experts, e0 + per_block)
                block = np.zeros((e1 - e0, layout.stride), dtype=np.uint8)
                for part in layout.parts:
                    rows = source.rows(part, e0, e1).view(np.uint8)
                    block[:, part.offset : part.offset + part.nbytes] = rows
                for r in block:
                    sums.append(record_checksum(memoryview(r)[: layout.record_bytes]))
                f.write(block.data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            free = shutil.disk_usage(path.parent).free
            raise ExpertDirError(
                f"no space left writing {path} ({e.strerror}; needs "
                f"{layout.num_experts * layout.stride} bytes, {free} free); free some space "
                "or choose another expert directory, then split again: completed layers "
                "are kept"
            ) from e
        raise
    return sums


def prepare_out_dir(out: Path) -> None:
    """Create ``out`` and check that it can be written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write_test.{os.getpid()}"  # ranks on one host probe at once
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ExpertDirError(
            f"cannot write the expert directory {out} ({e.strerror}); choose a "
            "writable location with enough space for the experts"
        ) from e


class LayerLocks:
    """Exclusive locks on single layers of an expert directory, shared with other
    processes (POSIX record locks: one byte of ``.split.lock`` per layer). The file
    stays open while the locks are used: closing any descriptor of it would drop them."""

    def __init__(self, out: Path):
        self.path = out / ".split.lock"

    def __enter__(self) -> LayerLocks:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    @contextlib.contextmanager
    def hold(self, layer: int):
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, layer)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, layer)


@contextlib.contextmanager
def meta_lock(out: Path):
    """An exclusive lock on ``out``'s meta, shared with other processes."""
    fd = os.open(out / ".meta.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
