"""Where each tensor of a safetensors checkpoint lies: file, byte offset, shape, dtype.

Only headers are read. Every entry is checked against its file's size when the index is
built, so a truncated or corrupt shard is reported before any data is used.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

ST_DTYPES = {
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "I8": "int8",
    "I32": "int32",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
}
_ITEMSIZE = {
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "int8": 1,
    "int32": 4,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
}


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated or malformed."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    offset: int  # absolute byte offset of the data in the file
    shape: tuple[int, ...]
    dtype: str  # our dtype name (see core.format.DTYPES)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Parse one safetensors file's header into entries, checking every bound."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, 100 << 20):
            raise CheckpointError(f"{path}: header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: malformed safetensors header ({e})") from e
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}"
            )
        begin, end = info["data_offsets"]
        e = TensorEntry(path, base + begin, tuple(info["shape"]), dtype)
        if end - begin != e.nbytes or base + end > size:
            raise CheckpointError(
                f"{path}: tensor {name} data is not within the file bounds; the checkpoint "
                "is corrupted or incomplete: download or convert it again"
            )
        out[name] = e
    return out


class SafetensorsIndex:
    """Name -> TensorEntry over all ``*.safetensors`` files of a model directory."""

    def __init__(self, model_dir: str | Path):
        self.root = Path(model_dir)
        files = sorted(self.root.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"No safetensors found in {self.root}")
        self.entries: dict[str, TensorEntry] = {}
        for f in files:
            self.entries.update(read_header(f))

    def get(self, name: str) -> TensorEntry | None:
        return self.entries.get(name)

    def read_rows(self, entry: TensorEntry, start: int, stop: int) -> bytes:
        """Bytes of rows ``start:stop`` along the first axis of a tensor."""
        row = entry.nbytes // entry.shape[0]
        fd = os.open(entry.file, os.O_RDONLY)
        try:
            want = (stop - start) * row
            data = os.pread(fd, want, entry.offset + start * row)
        finally:
            os.close(fd)
        if len(data) != want:
            raise CheckpointError(f"{entry.file}: short read ({len(data)} of {want} bytes)")
        return data
