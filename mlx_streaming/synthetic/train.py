"""Train a small MoE on text available offline: ``train_tiny``.

The text is the Python standard library's own sources (every ``.py`` file under
``sysconfig``'s stdlib path, sorted; every ``held_out_every``-th file is held out). The
model is mlx-lm's ``qwen3_moe`` built from a config, so ``mlx_lm.load`` reads the result
as it is; the tokenizer is a byte-level BPE trained on the training text and saved in the
Hugging Face format. mlx-lm's forward pass computes no load-balancing loss, so training
taps each router's logits and adds the Switch Transformer's auxiliary loss (``E * sum_e
f_e * P_e``): without it the routing collapses onto a few experts. Given a seed, the
same arguments give the same weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

TRAINED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-stdlib-moe"
# a completion model: chat turns are text to continue, with no role markers it never saw
CONTINUE_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
HELD_OUT_NAME = "held_out.txt"  # saved beside the weights: held-out text for evaluations
HELD_OUT_CHARS = 400_000


@dataclass(frozen=True)
class TrainConfig:
    """What ``train_tiny`` trains (defaults: the CPU-sized configuration)."""

    layers: int = 8
    hidden: int = 128
    experts: int = 32
    top_k: int = 4
    moe_inter: int = 64
    vocab: int = 1024
    seq: int = 128
    batch: int = 8
    steps: int = 300
    lr: float = 2e-3
    aux_weight: float = 0.01
    seed: int = 0
    held_out_every: int = 10
    max_chars: int = 4_000_000
    sources: str = "stdlib"  # "stdlib+site": the installed packages' too; or a directory
    bits: int | None = 4  # quantize the saved model (None: keep float)


def source_files(sources: str) -> list[tuple[Path, Path]]:
    """``(root, file)`` of every ``.py`` file to read, sorted: the standard library's
    (``stdlib``), with ``stdlib+site`` also the installed packages' (purelib), or those
    under a directory given by its path (a corpus carried to the training machine)."""
    paths = sysconfig.get_paths()
    named = {"stdlib": ["stdlib"], "stdlib+site": ["stdlib", "purelib"]}
    if sources in named:
        roots = [(Path(paths[key]), key == "stdlib") for key in named[sources]]
    elif Path(sources).is_dir():
        roots = [(Path(sources), False)]
    else:
        raise ValueError(f"sources {sources!r}: use stdlib, stdlib+site or a directory")
    out = []
    for root, skip_site in roots:
        files = sorted(root.rglob("*.py"))
        out += [(root, p) for p in files if not (skip_site and "site-packages" in p.parts)]
    return out


def corpus(max_chars: int, held_out_every: int, sources: str = "stdlib"):
    """``(train text, held-out text, files read)`` from Python sources on this machine."""
    train, held, used, n = [], [], [], 0
    for i, (root, f) in enumerate(source_files(sources)):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if i % held_out_every == 0 else train).append(text)
        used.append(f"{root.name}/{f.relative_to(root)}")
        n += len(text)
        if n >= max_chars:
            break
    return "\n".join(train), "\n".join(held), used


def model_config(cfg: TrainConfig, vocab_size: int, eos_id: int) -> dict:
    """An mlx-lm ``qwen3_moe`` config of ``cfg``'s shape."""
    return {
        "model_type": "qwen3_moe",
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "intermediate_size": 2 * cfg.hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": cfg.hidden // 4,
        "num_experts": cfg.experts,
        "num_experts_per_tok": cfg.top_k,
        "moe_intermediate_size": cfg.moe_inter,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "eos_token_id": eos_id,
    }


class RouterTap(nn.Module):
    """A router that also keeps its logits of the last call (for the auxiliary loss)."""

    def __init__(self, gate: nn.Module, sink: list):
        super().__init__()
        self.gate = gate
        self._sink = sink

    def __call__(self, x):
        logits = self.gate(x)
        self._sink.append(logits)
        return logits


@contextlib.contextmanager
def tapped_routers(model):
    """Within the block, every MoE block's router appends its logits of each call to the
    list yielded; the routers are put back after."""
    sink: list = []
    blocks = [layer.mlp for layer in model.model.layers]
    for b in blocks:
        b.gate = RouterTap(b.gate, sink)
    try:
        yield sink
    finally:
        for b in blocks:
            b.gate = b.gate.gate


def balance_loss(logits: mx.array, top_k: int) -> mx.array:
    """Switch Transformer's load-balancing loss: experts x sum over experts of (share of
    top-k picks) x (mean router probability); 1.0 when routing is uniform."""
    E = logits.shape[-1]
    probs = mx.softmax(logits.reshape(-1, E).astype(mx.float32), axis=-1)
    picks = mx.argpartition(-probs, kth=top_k - 1, axis=-1)[:, :top_k]
    share = mx.zeros((E,)).at[picks.reshape(-1)].add(1.0) / picks.size
    return E * (mx.stop_gradient(share) * probs.mean(axis=0)).sum()


def routing_stats(model, tokens: np.ndarray, experts: int, top_k: int, seq: int) -> dict:
    """Per MoE layer, on held-out tokens: routing entropy (bits) and usage histogram."""
    from ..planning.simulate import routing_entropy

    counts = np.zeros((len(model.model.layers), experts))
    with tapped_routers(model) as sink:
        for i in range(0, min(len(tokens) - 1, 16 * seq), seq):
            sink.clear()
            model(mx.array(tokens[i : i + seq])[None])
            for li, logits in enumerate(sink):
                picks = np.array(mx.argpartition(-logits, kth=top_k - 1, axis=-1)[..., :top_k])
                counts[li] += np.bincount(picks.reshape(-1), minlength=experts)
    ent = routing_entropy(counts)
    return {"entropy_bits": ent.round(3).tolist(), "max_bits": round(float(np.log2(experts)), 3),
            "usage": counts.astype(int).tolist()}  # fmt: skip


# how the demo and chat sample the trained model: greedy decoding loops on a model this
# small, and higher temperatures drift off Python (read on the committed model)
TRAINED_SAMPLING = {"temp": 0.6, "top_p": 0.9, "repetition_penalty": 1.2}


def trained_checkpoint() -> Path | None:
    """The trained model committed with the repository (``checkpoints/tiny-stdlib-moe``),
    or None where it is absent (an installed wheel does not carry it)."""
    return TRAINED if (TRAINED / "config.json").exists() else None


def held_out_text(model_dir: str | Path) -> str:
    """The held-out text saved with a ``train_tiny`` checkpoint (the start of the held-out
    files, as read on the machine that trained it)."""
    path = Path(model_dir) / HELD_OUT_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {model_dir} is not a train-tiny checkpoint")
    return path.read_text(encoding="utf-8")


def held_out_loss(model, ids: np.ndarray, seq: int, windows: int = 32) -> float:
    """Mean next-token cross-entropy (nats) over the first ``windows`` windows of ``seq``
    tokens of ``ids`` (the held-out text)."""
    n = min(windows, (len(ids) - 1) // seq)
    if n < 1:
        raise ValueError(f"held-out text has {len(ids)} tokens, fewer than one window of {seq}")
    held = ids[: n * seq + 1]
    x, y = mx.array(held[:-1].reshape(n, seq)), mx.array(held[1:].reshape(n, seq))
    return float(nn.losses.cross_entropy(model(x), y, reduction="mean"))


def _train(model, sink: list, train_ids: np.ndarray, rng, cfg: TrainConfig, log) -> list:
    """AdamW steps on random windows of ``train_ids``; cross-entropy plus the balance
    loss on the routers' logits (``sink``). Returns the loss curve."""
    import mlx.optimizers as optim

    def loss_fn(model, x, y):
        sink.clear()
        ce = nn.losses.cross_entropy(model(x), y, reduction="mean")
        aux = sum(balance_loss(lg, cfg.top_k) for lg in sink) / len(sink)
        return ce + cfg.aux_weight * aux, (ce, aux)

    step = nn.value_and_grad(model, loss_fn)
    opt = optim.AdamW(optim.cosine_decay(cfg.lr, cfg.steps), weight_decay=0.01)
    curve, t0 = [], time.perf_counter()
    for i in range(cfg.steps):
        starts = rng.integers(0, len(train_ids) - cfg.seq - 1, cfg.batch)
        batch = np.stack([train_ids[s : s + cfg.seq + 1] for s in starts])
        (_, (ce, aux)), grads = step(model, mx.array(batch[:, :-1]), mx.array(batch[:, 1:]))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
        if i % max(1, cfg.steps // 20) == 0 or i == cfg.steps - 1:
            tps = (i + 1) * cfg.batch * cfg.seq / (time.perf_counter() - t0)
            curve.append({"step": i, "loss": round(float(ce), 4), "aux": round(float(aux), 4),
                          "tokens_per_s": round(tps)})  # fmt: skip
            log(f"step {i}: loss {curve[-1]['loss']} aux {curve[-1]['aux']} ({tps:,.0f} tok/s)")
    return curve


def train_tiny(
    out_dir: str | Path,
    cfg: TrainConfig = TrainConfig(),
    log=print,
    float_dir: str | Path | None = None,
    command: str = "",
) -> dict:
    """Train, evaluate on held-out text and save an MLX checkpoint to ``out_dir``;
    returns the report (also written there as ``training.json``). ``float_dir`` also
    keeps the unquantized model (the reference for quality measurements)."""
    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import quantize_model

    from .build import EOS_TOKEN, build_tokenizer, save_checkpoint

    t0 = time.perf_counter()
    train_text, held_text, files = corpus(cfg.max_chars, cfg.held_out_every, cfg.sources)
    tok = build_tokenizer(
        cfg.vocab, [train_text[i : i + 20000] for i in range(0, len(train_text), 20000)]
    )
    tok.chat_template = CONTINUE_TEMPLATE
    train_ids = np.array(tok.encode(train_text), dtype=np.int32)
    held_ids = np.array(tok.encode(held_text), dtype=np.int32)
    config = model_config(cfg, len(tok), tok.convert_tokens_to_ids(EOS_TOKEN))
    mx.random.seed(cfg.seed)
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    rng = np.random.default_rng(cfg.seed)
    with tapped_routers(model) as sink:
        curve = _train(model, sink, train_ids, rng, cfg, log)
    held_loss = held_out_loss(model, held_ids, cfg.seq)
    report = {
        "config": asdict(cfg),
        "command": command,
        "train_tokens_seen": cfg.steps * cfg.batch * cfg.seq,
        "train_tokens": int(len(train_ids)),
        "held_out_tokens": int(len(held_ids)),
        "held_out_loss": round(held_loss, 4),
        "held_out_perplexity": round(float(np.exp(held_loss)), 3),
        "routing": routing_stats(model, held_ids, cfg.experts, cfg.top_k, cfg.seq),
        "curve": curve,
        "seconds": round(time.perf_counter() - t0, 1),
        "text": {
            "source": f"Python sources on the training machine ({cfg.sources})",
            "files": files,
            "held_out": f"every {cfg.held_out_every}th file",
        },  # fmt: skip
    }
    if float_dir is not None:
        extra = {"training.json": report, HELD_OUT_NAME: held_text[:HELD_OUT_CHARS]}
        save_checkpoint(Path(float_dir), model, config, tok, extra, donate=False)
    if cfg.bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, 64, cfg.bits)
        q_loss = held_out_loss(model, held_ids, cfg.seq)
        report["held_out_loss_quantized"] = round(q_loss, 4)
        report["held_out_perplexity_quantized"] = round(float(np.exp(q_loss)), 3)
    extra = {"training.json": report, HELD_OUT_NAME: held_text[:HELD_OUT_CHARS]}
    save_checkpoint(Path(out_dir), model, config, tok, extra)
    return report


def report_lines(report: dict) -> str:
    """A few lines a person reads."""
    r = report["routing"]
    return "\n".join([
        f"held-out loss {report['held_out_loss']} (perplexity {report['held_out_perplexity']})",
        f"routing entropy per layer {r['entropy_bits']} of {r['max_bits']} bits",
        json.dumps(report["curve"][-1]),
    ])  # fmt: skip
