"""One thread drives a store: its slot tables and policies take no lock, so a second
thread that enters while one is inside is refused, not left to race."""

from __future__ import annotations

import contextlib
import threading


class Driver:
    """The guard of a store's entries that change its tables (``request``, ``step``,
    ``finish``, ``prefetch``, ``pin``, ``close``): ``enter``/``leave`` on the hot path,
    ``held`` elsewhere."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside: tuple[int, str] | None = None  # (thread id, entry) of the holder

    def enter(self, what: str) -> None:
        """Take the store for this thread.

        Raises:
            RuntimeError: the store is taken (naming both entries and the fix).
        """
        if not self._lock.acquire(blocking=False):
            holder = self._inside or (None, "?")
            if holder[0] == threading.get_ident():
                raise RuntimeError(
                    f"the store's {what} was called from inside its own {holder[1]} on one "
                    "thread (e.g. by a watch or an observer): call it after that returns"
                )
            raise RuntimeError(
                f"two threads called one store at once ({what} while another thread is "
                f"in {holder[1]}): a store is driven by one thread (the server's "
                "generation thread); serialize the generations, or load a store per thread"
            )
        self._inside = (threading.get_ident(), what)

    def leave(self) -> None:
        self._inside = None
        self._lock.release()

    @contextlib.contextmanager
    def held(self, what: str):
        self.enter(what)
        try:
            yield
        finally:
            self.leave()
