"""A MoE layer's shared experts, started beside the routing.

Where the host reads a call's routing (the CPU, Metal, prompts on CUDA), the device has
nothing queued from that read until the call's expert graph is launched: the host plans
and the misses load meanwhile. The shared experts (DeepSeek's ``shared_experts``, Qwen's
``shared_expert``) need only the layer's input, so ``StreamedExperts`` builds them first
(``start``) and the host path launches them right after the routing: the device computes
them in that gap. mlx-lm's MoE block then calls the module as always and gets that same
array, the same ops on the same input, so outputs stay bit-identical.

A block that calls its shared experts on another input (a reshaped or normalised copy),
or before its routed experts, would pay them twice: the first such call switches ``start``
off for that layer.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

SHARED_NAMES = ("shared_experts", "shared_expert")


class SharedAhead(nn.Module):
    """Wraps a MoE block's shared-expert module; ``start`` computes it early."""

    def __init__(self, shared: nn.Module):
        super().__init__()
        self.shared = shared
        object.__setattr__(self, "_held", None)  # (input, output) of the last start
        object.__setattr__(self, "ahead", True)  # off once a start went unused

    def start(self, x: mx.array) -> mx.array | None:
        """The shared experts' output on ``x``, for the block's next call; None once
        this block was seen not to use it."""
        if self._held is not None:  # the block never asked for the last one
            self._stop()
        if not self.ahead:
            return None
        y = self.shared(x)
        object.__setattr__(self, "_held", (x, y))
        return y

    def __call__(self, x: mx.array) -> mx.array:
        held = self._held
        if held is None:
            return self.shared(x)
        object.__setattr__(self, "_held", None)
        if held[0] is x:
            return held[1]
        self._stop()
        return self.shared(x)

    def _stop(self) -> None:
        object.__setattr__(self, "_held", None)
        object.__setattr__(self, "ahead", False)


def wrap_shared(block: nn.Module) -> SharedAhead | None:
    """Put a ``SharedAhead`` around ``block``'s shared experts, if it has any."""
    for name in SHARED_NAMES:
        child = block.get(name)
        if isinstance(child, nn.Module):
            wrapped = SharedAhead(child)
            block.update_modules({name: wrapped})
            return wrapped
    return None
