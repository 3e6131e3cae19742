"""Build synthetic MoE checkpoints in real mlx-lm architectures.

The real mlx-lm model class with random weights, routers scaled so that routing is
peaked and varies across tokens, quantized with mlx-lm's own ``quantize_model`` and saved
with ``save_model`` / ``save_config``, plus a small byte-level BPE tokenizer with a chat
template. The result loads with ``mlx_lm.load`` like any mlx-community checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..analysis.capture import capture_inputs
from .presets import PRESETS, Preset

# Text the tokenizer is trained on: enough merges for a few hundred tokens, English and
# Chinese (the seed script's default prompt is Chinese).
_CORPUS = [
    "A mixture of experts model routes each token to a few experts out of many. "
    "Only the chosen experts run, so a large model costs little compute per token. "
    "The experts that are not used stay on disk and are read when they are needed.",
    "The quick brown fox jumps over the lazy dog. Streaming keeps the trunk resident: "
    "attention, norms, embeddings, routers and shared experts. Each layer holds a pool "
    "of expert slots, and a miss loads the expert from the solid state drive.",
    "用三句话解释什么是混合专家模型。混合专家模型把每个词元交给少数几个专家处理。"
    "没有被选中的专家不参与计算，所以大模型的每步计算量很小。",
    "def generate(model, prompt):\n    return model(prompt)\n"
    "Question: what is a cache? Answer: a small fast memory that keeps what was used "
    "recently, in the hope that it is used again soon. 0123456789 + - * / = ( ) [ ] { }",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 512, texts: list[str] | None = None):
    """A deterministic byte-level BPE tokenizer with a ChatML-style chat template,
    trained on ``texts`` (default: a small built-in corpus)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else _CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _model_classes(model_type: str):
    try:
        arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    except ImportError as e:
        raise ValueError(
            f"mlx-lm has no architecture '{model_type}' (mlx_lm.models.{model_type}); "
            "check the model_type or upgrade mlx-lm"
        ) from e
    return arch.Model, arch.ModelArgs


def _popularity(model: nn.Module, sites, tokenizer, seed: int, spread: float = 1.0) -> None:
    """Make some experts more popular in routers that have no bias of their own.

    Adds to each expert's router row a multiple of the mean direction ``u`` of the layer's
    inputs, scaled so that its logit moves by ``b_e ~ N(0, spread)`` on an average input.
    """
    inputs = capture_inputs(model, tokenizer.encode(" ".join(_CORPUS)))
    key = mx.random.key(seed + 2)
    for s in sites:
        x = inputs[s.layer][0].astype(mx.float32)
        m = x.sum(axis=0) / x.shape[0]
        norm2 = (m * m).sum()
        if (
            s.router is None
            or norm2.item() == 0
            or any(n in s.router for n in ("bias", "e_score_correction_bias"))
        ):
            continue
        k1, key = mx.random.split(key)
        b = mx.random.normal((s.num_experts, 1), key=k1) * spread
        w = s.router.weight
        s.router.weight = (w + b * m[None] / norm2).astype(w.dtype)


def _sites_or_none(model: nn.Module) -> list:
    """The model's expert sites; none for a dense model (used in tests of bad input)."""
    from ..core.discovery import UnsupportedModelError, find_expert_sites

    try:
        return find_expert_sites(model)
    except UnsupportedModelError:
        return []


def _shape_routers(model: nn.Module, scale: float, seed: int) -> None:
    """Sharpen and skew the routers so routing is peaked and not uniform."""
    key = mx.random.key(seed + 1)
    for site in _sites_or_none(model):
        router = site.router
        if router is None:
            continue
        k1, k2, key = mx.random.split(key, 3)
        w = router.weight
        # Some routers (DeepSeek's MoEGate) start at zero: draw them like nn.Linear.
        bound = w.shape[1] ** -0.5
        w = mx.random.uniform(-bound, bound, w.shape, key=k1) * scale
        router.weight = w.astype(router.weight.dtype)
        # A per-expert offset makes some experts more popular, as in real models;
        # DeepSeek's correction bias adds to sigmoid scores in [0, 1], so it is smaller.
        for name, size in (("bias", 0.5), ("e_score_correction_bias", 0.05)):
            if name in router:
                skew = mx.random.normal((site.num_experts,), key=k2) * size
                router[name] = (router[name] + skew).astype(router[name].dtype)


def _silence_eos(model: nn.Module, eos_ids: list[int]) -> None:
    """Zero the output row of EOS so greedy decoding never stops early.

    With random weights the other logits are symmetric around 0, so a zero logit is
    never the maximum: benchmarks get exactly the token counts they ask for.
    """
    head = getattr(model, "lm_head", None)
    tables = [head] if head is not None and "weight" in head else []
    emb = model.model.embed_tokens if hasattr(model, "model") else None
    if emb is not None and not tables:
        tables.append(emb)  # tied embeddings
    for t in tables:
        w = t.weight
        mask = mx.ones((w.shape[0], 1), dtype=w.dtype)
        mask[mx.array(eos_ids)] = 0
        t.weight = w * mask


def make_checkpoint(
    out_dir: str | Path,
    preset: str | Preset = "demo",
    *,
    bits: int | None = -1,
    group_size: int | None = None,
    dtype: str | None = None,
    num_layers: int | None = None,
    seed: int = 0,
    overrides: dict | None = None,
    force: bool = False,
) -> Path:
    """Write a synthetic MLX-format MoE checkpoint.

    Args:
        out_dir: Destination directory; written under a temporary name and renamed, so
            a directory that exists is complete.
        preset: A name from ``PRESETS`` or a ``Preset``.
        bits: 4, 8, ... or ``None`` for unquantized; ``-1`` keeps the preset's.
        group_size: Quantization group size (default: the preset's).
        dtype: ``float32``, ``bfloat16`` or ``float16`` (default: the preset's).
        num_layers: Override the number of layers.
        seed: Random seed; the same arguments give the same bytes.
        overrides: Extra config keys.
        force: Rebuild even if ``out_dir`` exists.

    Returns:
        The checkpoint directory.
    """
    from mlx_lm.utils import quantize_model

    p = PRESETS[preset] if isinstance(preset, str) else preset
    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out = Path(out_dir)
    if out.exists() and not force:
        if (out / "config.json").exists():
            return out
        raise FileExistsError(f"{out} exists and is not a checkpoint; remove it or pass force")
    bits = p.bits if bits == -1 else bits
    group_size = group_size or p.group_size
    dtype = dtype or p.dtype

    tokenizer = build_tokenizer(p.vocab)
    config = copy.deepcopy(p.config)
    config.update(overrides or {})
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
        if "layer_types" in config:
            config["layer_types"] = (config["layer_types"] * num_layers)[:num_layers]
    config["vocab_size"] = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config["eos_token_id"] = eos_id

    model_cls, args_cls = _model_classes(config["model_type"])
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    _shape_routers(model, p.router_scale, seed)
    if p.popularity and _sites_or_none(model):
        model.set_dtype(mx.float32)  # calibrate in float32 (MLX's CPU gather_mm needs it);
        _popularity(model, _sites_or_none(model), tokenizer, seed, p.popularity)
        model.set_dtype(getattr(mx, dtype))  # bf16 -> f32 -> bf16 round-trips exactly
    _silence_eos(model, [eos_id])
    if bits is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits)

    info = {
        "preset": p.name,
        "bits": bits,
        "group_size": group_size,
        "dtype": dtype,
        "seed": seed,
        "description": p.description,
    }
    return save_checkpoint(out, model, config, tokenizer, {"synthetic.json": info})


def save_checkpoint(
    out: Path, model, config: dict, tokenizer, extra: dict, *, donate: bool = True
) -> Path:
    """Write an MLX-format checkpoint (weights, config, tokenizer, ``extra`` JSON files)
    under a temporary name, then rename it: a directory that exists is complete.
    ``extra``: file name -> JSON-able object, or a string written as text. ``donate``:
    the model's weights are freed as they are written."""
    from mlx_lm.utils import save_config, save_model

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(tmp, model, donate_model=donate)
    save_config(config, tmp / "config.json")
    tokenizer.save_pretrained(str(tmp))
    for name, obj in extra.items():  # JSON, or text as it is
        with open(tmp / name, "w") as f:
            f.write(obj) if isinstance(obj, str) else json.dump(obj, f, indent=2)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Total bytes of a checkpoint's safetensors files."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
