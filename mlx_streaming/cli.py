"""``python -m mlx_streaming <command>``: dispatch to the command modules."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "split": "split experts of a checkpoint into an expert directory",
    "generate": "generate text with a streamed model",
    "chat": "chat with a streamed model",
    "serve": "an OpenAI-compatible server over a streamed model",
    "bench": "benchmark a streamed model (the seed script's fields), optionally vs stock",
    "plan": "predict hit rate and tok/s of each budget and policy from a routing trace",
    "profile": "write pool_profile.json (per-layer slots) from a routing trace",
    "requantize": "requantize experts to fewer bits (per projection / per layer)",
    "verify": "check, layer by layer, that streamed experts equal stock mlx-lm's bit for bit",
    "quality": "KL divergence, top-1 agreement and projection errors of requantized experts",
    "demo": "build a synthetic model, stream it and check it against stock mlx-lm",
    "synth": "write a synthetic MoE checkpoint",
    "train-tiny": "train a small MoE on offline text (real routing, readable output)",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m mlx_streaming <command> [options]\n\ncommands:")
        for name, text in COMMANDS.items():
            print(f"  {name:<10} {text}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nunknown command {argv[0]!r}", file=sys.stderr)
            sys.exit(2)
        return
    module = importlib.import_module(f"mlx_streaming.commands.{argv[0].replace('-', '_')}")
    try:
        module.main(argv[1:])
    except (ValueError, OSError) as e:
        # bad input, a file that cannot be read or written, a port in use: the message
        # names the file or value and the fix; no traceback
        print(f"mlx_streaming {argv[0]}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:  # the user stopped it: no traceback
        print(f"mlx_streaming {argv[0]}: interrupted", file=sys.stderr)
        sys.exit(130)
    except RuntimeError as e:
        from .core.io.ring import unexplained_failure
        from .parallel import PipelineError, lost_peer

        err = lost_peer(e)
        if not isinstance(err, PipelineError):
            failed = unexplained_failure()  # a kernel's read from the files: it trapped
            if failed is None:
                raise
            err = f"{failed} (a read the GPU asked for; the step stopped: {e})"
        print(f"mlx_streaming {argv[0]}: error: {err}", file=sys.stderr)
        sys.exit(1)


def _command(name: str):
    def run() -> None:
        main([name, *sys.argv[1:]])

    run.__name__ = name
    return run


(
    split,
    generate,
    chat,
    serve,
    bench,
    plan,
    profile,
    requantize,
    verify,
    quality,
    demo,
    synth,
    train_tiny,
) = (  # fmt: skip
    _command(n)
    for n in (
        "split",
        "generate",
        "chat",
        "serve",
        "bench",
        "plan",
        "profile",
        "requantize",
        "verify",
        "quality",
        "demo",
        "synth",
        "train-tiny",
    )
)

if __name__ == "__main__":
    main()
