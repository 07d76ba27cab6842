"""TensorBoard scalars written by rank 0, in TensorBoard's own event-file format, without TensorBoard.

An event file is a sequence of TFRecords (length, masked CRC-32C of the length, data, masked CRC-32C of
the data), each holding one serialized `tensorflow.Event` protocol buffer: a first one naming the file
version, then one per step with the step's scalar values. Writing the few fields needed by hand keeps
tensorboard (and its protobuf and grpc dependencies) out of the trainer image; TensorBoard's own reader
loads these files (tests/e2e/test_tensorboard.py).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path
from typing import IO


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant, so that CRCs of CRCs differ."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, scalars: dict[str, float] | None = None, file_version: str | None = None
          ) -> bytes:
    """A serialized Event: wall_time (1, double), step (2, int64), file_version (3) or summary (5), whose
    values (1) each carry a tag (1) and a simple_value (2, float)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _field(5, values)
    return out


def record(data: bytes) -> bytes:
    """One TFRecord."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))


class ScalarWriter:
    """Rank 0's event file in `<checkpoint dir>/tensorboard/` (contract.TENSORBOARD_DIR), one per generation (TensorBoard reads every
    file in the directory as one run). Flushed after every step: a killed worker loses nothing written."""

    def __init__(self, directory: Path, generation: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.gen{generation}"
        self.file: IO[bytes] = (directory / name).open("ab")
        self._write(event(time.time(), 0, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        self.file.write(record(data))
        self.file.flush()

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """Tags such as `train/loss`; values that are None (not known on this device) are left out."""
        known = {tag: float(v) for tag, v in values.items() if v is not None}
        if known:
            self._write(event(time.time(), step, known))

    def close(self) -> None:
        self.file.close()
