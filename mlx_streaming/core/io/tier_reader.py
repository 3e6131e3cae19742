"""The store's reader over a swap tier of host pools (``tier.SwapTier``): the tier's
bookkeeping and its trades run, and are tested, on any machine; on CUDA the GPU trades
with the tier instead (``DeviceReader``)."""

from __future__ import annotations

from .tier import SwapTier


class TierReader:
    """The store's reader over a ``SwapTier`` of host pools: each miss trades places with
    its victim on the calling thread; with a partial tier, a miss outside it is then read
    by ``files`` (the store's file reader)."""

    wave = None  # any number of records per start

    def __init__(self, tier: SwapTier, files=None):
        self.tier, self.files = tier, files

    @property
    def mapped_bytes(self) -> int:
        return self.tier.nbytes

    def start(self, layer: int, experts, slots):
        """Trade ``experts`` into ``slots`` now, then start the reads of those outside
        the tier; the result is the bytes brought in.

        Raises:
            TierError: see ``SwapTier.plan`` (nothing moved).
        """
        return self.tier.take(layer, experts, slots, self.tier.trade_on_host, self.files)

    def read_gbps(self) -> float:
        return self.files.read_gbps() if self.files is not None else 0.0

    def reset_counters(self) -> None:
        self.tier.traded_bytes = 0
        if self.files is not None:
            self.files.reset_counters()

    def close(self) -> None:
        try:
            if self.files is not None:
                self.files.close()
        finally:
            self.tier.close()
