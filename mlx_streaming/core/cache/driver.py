"""One thread drives a store: its slot tables and policies take no lock, so a second
thread that enters while one is inside is refused, not left to race."""

from __future__ import annotations

import contextlib
import threading


class Driver:
    """The guard of a store's entries that change its tables (``request``, ``prefetch``,
    ``pin``): ``enter``/``leave`` on the hot path, ``held`` elsewhere."""

    def __init__(self):
        self._lock = threading.Lock()

    def enter(self, what: str) -> None:
        """Take the store for this thread.

        Raises:
            RuntimeError: another thread is inside (naming ``what`` and the fix).
        """
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"two threads called one store's {what} at once: a store is driven by one "
                "thread (the server's generation thread); serialize the generations, or "
                "load a store per thread"
            )

    def leave(self) -> None:
        self._lock.release()

    @contextlib.contextmanager
    def held(self, what: str):
        self.enter(what)
        try:
            yield
        finally:
            self.leave()
