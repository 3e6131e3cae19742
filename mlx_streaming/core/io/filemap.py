"""Read-only mappings of the expert files, for readers that copy records straight from the
page cache (the GPU's own copies on CUDA). Knows nothing of the engine or the pools.

With ``cuda`` each mapping is page-locked (registered read-only), so that the device can
read it; that keeps every mapped file in host memory while the maps live.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable

import numpy as np

from ..format import ExpertChecksumError, record_checksum


class FileMaps:
    """Each layer's expert file mapped read-only.

    Args:
        meta: The expert directory's ``ExpertMeta``.
        layers: The layers whose files to map.
        cuda: The CUDA runtime module (``io.cuda``) to page-lock each mapping with, or
            None (no page-locking).
        tick: Called after each layer's file is mapped (e.g. a pipeline's ``Pace.tick``).

    Raises:
        OSError: a file cannot be opened, mapped or page-locked (naming it); whatever
            was mapped before is released.
    """

    def __init__(self, meta, layers, cuda=None, tick: Callable[[], None] | None = None):
        self.meta, self._cuda = meta, cuda
        self.sources: dict[int, int] = {}  # layer -> host address of its file's mapping
        self.nbytes = 0  # of the files mapped
        self._maps: list[tuple[mmap.mmap, int]] = []
        try:
            for li in layers:
                self._map(li)
                if tick is not None:
                    tick()
        except BaseException:
            self.close()
            raise

    def _map(self, li: int) -> None:
        path, lay = self.meta.file(li), self.meta.layers[li]
        with open(path, "rb") as f:
            size, need = os.fstat(f.fileno()).st_size, lay.num_experts * lay.stride
            if size < need:  # a page mapped past the end would fault when read
                raise OSError(f"{path} holds {size} bytes ({need} needed): split the model again")
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)  # outlives the fd
        view = np.frombuffer(m, np.uint8)
        addr = view.ctypes.data  # stays valid while m is open
        del view  # no exported buffer: m can be closed
        if self._cuda is not None:
            try:
                self._cuda.register_read_only(addr, size)
            except Exception as e:
                m.close()
                raise OSError(
                    f"{path}: could not page-lock its mapping ({e}); read without map_files"
                ) from e
        self._maps.append((m, addr))
        self.sources[li] = addr
        self.nbytes += size

    def verify(self, layer: int, checked: np.ndarray) -> None:
        """Check, on the host, the checksum of every record of ``layer`` whose
        ``checked[e]`` is 0, setting it to 1 (before a device copies records from the
        mapping without a reader's check).

        Raises:
            ExpertChecksumError: naming the file and the first bad expert.
            OSError: the file shrank under its mapping (its pages past the end would fault).
        """
        lay, path = self.meta.layers[layer], self.meta.file(layer)
        if not lay.checksums:
            return
        need, size = lay.num_experts * lay.stride, os.stat(path).st_size
        if size < need:
            raise OSError(f"{path} shrank to {size} bytes ({need} needed): split the model again")
        view = np.frombuffer((ctypes.c_uint8 * need).from_address(self.sources[layer]), np.uint8)
        for e in np.flatnonzero(checked == 0).tolist():
            rec = view[e * lay.stride : e * lay.stride + lay.record_bytes]
            if record_checksum(rec) != lay.checksums[e]:
                raise ExpertChecksumError(
                    f"expert {e} of layer {layer} in {path} fails its checksum: the file is "
                    "corrupt; split the model again"
                )
            checked[e] = 1

    def close(self) -> None:
        """Unregister (with cuda) and unmap every file (idempotent): each one, whatever
        another's unregistering raised (the first such error is raised after)."""
        maps, self._maps, self.sources, self.nbytes = self._maps, [], {}, 0
        first = None
        for m, addr in maps:
            try:
                if self._cuda is not None:
                    self._cuda.unregister(addr)
            except Exception as e:  # noqa: BLE001 - raised once all are released
                first = first or e
            finally:
                m.close()
        if first is not None:
            raise first

    def __enter__(self) -> FileMaps:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
