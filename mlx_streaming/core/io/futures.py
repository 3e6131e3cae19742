"""The futures of reads: a finished one (``Done``), one over several parts (``Gather``)
that never reports while a part still writes, and a native reader's started read
(``Started``)."""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from .native import NativeReader


class Done:
    """A finished read: the cheap stand-in for a Future on the inline path."""

    def __init__(self, value=None, error: Exception | None = None):
        self._value, self._error = value, error

    def done(self) -> bool:
        return True

    def result(self, timeout=None):
        if self._error is not None:
            raise self._error
        return self._value


def _wait_all(parts: list[Future]) -> None:
    """Wait until every part has stopped, through further interrupts (reads are bounded)."""
    while not all(p.done() for p in parts):
        try:
            wait(parts)
        except BaseException:  # noqa: BLE001 - re-raised by the caller once all stopped
            continue


class Gather(Future):
    """A future over several reads; its result is their byte total."""

    def __init__(self, parts: list[Future], finish):
        super().__init__()
        self._parts, self._finish = parts, finish

    def done(self):
        return super().done() or all(p.done() for p in self._parts)

    def result(self, timeout=None):
        """The parts' byte total once every part has stopped (their first error raised).

        Raises:
            TimeoutError: parts still run after ``timeout`` seconds; the future stays
                pending (a later call can still collect it).
        """
        if not super().done():
            try:  # every read has stopped writing before we report
                _, running = wait(self._parts, timeout)
            except BaseException:  # e.g. Ctrl-C: the threads still write into the slots,
                _wait_all(self._parts)  # which the caller frees on the way out: let them end
                raise
            if running:
                raise concurrent.futures.TimeoutError(  # 3.10's is not the builtin
                    f"{len(running)} of {len(self._parts)} reads still running after {timeout} s"
                )
            try:
                self.set_result(self._finish(sum(p.result(0) for p in self._parts)))
            except Exception as e:  # noqa: BLE001
                self.set_exception(e)
        return super().result(timeout)


class Started:
    """A read a native reader began (``native.NativeReader.start``): ``result()`` waits
    for it (bytes read, or the read's error), ``done()`` says whether it has landed."""

    def __init__(self, reader: NativeReader, layer: int, experts: np.ndarray):
        self.reader, self.layer, self.experts = reader, layer, experts
        self.outcome: int | BaseException | None = None  # set when the read is finished

    def done(self) -> bool:
        """Whether the read has landed (``result()`` then returns at once)."""
        return self.outcome is not None or self.reader.staged()

    def result(self) -> int:
        """The bytes read; raises the read's error (the same one on every call)."""
        if self.outcome is None:
            self.reader.wait_started()  # this read: every other one was collected
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome
