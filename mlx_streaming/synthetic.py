"""Synthetic MoE checkpoints in real mlx-lm architectures.

Tests, the demo and the benchmarks need MoE models without downloading any. This module
builds one from a small config: the real mlx-lm model class with random weights, routers
scaled so that routing is peaked and varies across tokens, quantized with mlx-lm's own
``quantize_model`` and saved with ``save_model`` / ``save_config``, plus a small byte-level
BPE tokenizer with a chat template. The result loads with ``mlx_lm.load`` like any
mlx-community checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

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


@dataclass(frozen=True)
class Preset:
    """A synthetic checkpoint recipe: an mlx-lm config plus quantization and dtype."""

    name: str
    config: dict
    bits: int | None = 4  # None: unquantized
    group_size: int = 64
    dtype: str = "float32"
    router_scale: float = 6.0
    popularity: float = 1.5  # spread of per-expert logit offsets (0: none)
    description: str = ""
    vocab: int = 512  # tokenizer vocabulary target
    extra: dict = field(default_factory=dict)


def _qwen3_next(layers, hidden, experts, top_k, moe_inter, mlp_only=(), **kw):
    cfg = {
        "model_type": "qwen3_next",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": hidden // 4,
        "linear_value_head_dim": hidden // 4,
        "linear_conv_kernel_dim": 4,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": moe_inter,
        "mlp_only_layers": list(mlp_only),
        "moe_intermediate_size": moe_inter,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 8192,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
        "full_attention_interval": 4,
    }
    cfg.update(kw)
    return cfg


def _deepseek_v2(layers, hidden, experts, top_k, moe_inter, shared=2, dense=1, **kw):
    cfg = {
        "model_type": "deepseek_v2",
        "hidden_size": hidden,
        "intermediate_size": 4 * hidden,
        "moe_intermediate_size": moe_inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "n_shared_experts": shared,
        "n_routed_experts": experts,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 64,
        "q_lora_rank": None,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "qk_nope_head_dim": 32,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": top_k,
        "moe_layer_freq": 1,
        "first_k_dense_replace": dense,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
    }
    cfg.update(kw)
    return cfg


_TINY = 128  # hidden size of the per-architecture test presets

PRESETS: dict[str, Preset] = {
    # One tiny preset per supported architecture, for tests. Dense layers sit between
    # MoE layers where the architecture allows it.
    "tiny-qwen3_next": Preset(
        "tiny-qwen3_next", _qwen3_next(4, _TINY, 16, 4, 64, mlp_only=(1,)),
        description="Qwen3-Next: linear + full attention, shared expert, a dense layer 1",
    ),
    "tiny-qwen3_moe": Preset(
        "tiny-qwen3_moe",
        {
            "model_type": "qwen3_moe", "hidden_size": _TINY, "num_hidden_layers": 4,
            "intermediate_size": 2 * _TINY, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_experts": 16,
            "num_experts_per_tok": 4, "decoder_sparse_step": 1, "mlp_only_layers": [0],
            "moe_intermediate_size": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "max_position_embeddings": 8192,
            "norm_topk_prob": True,
        },
        description="Qwen3-MoE with a dense first layer",
    ),
    "tiny-mixtral": Preset(
        "tiny-mixtral",
        {
            "model_type": "mixtral", "hidden_size": _TINY, "num_hidden_layers": 3,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
        },
        description="Mixtral: block_sparse_moe.switch_mlp, 8 experts, top-2",
    ),
    "tiny-deepseek_v3": Preset(
        "tiny-deepseek_v3",
        {
            "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": _TINY,
            "intermediate_size": 2 * _TINY, "moe_intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
            "n_shared_experts": 1, "n_routed_experts": 16, "routed_scaling_factor": 2.5,
            "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16,
            "v_head_dim": 32, "qk_nope_head_dim": 32, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 4,
            "topk_group": 2, "num_experts_per_tok": 4, "moe_layer_freq": 1,
            "first_k_dense_replace": 1, "max_position_embeddings": 8192,
        },
        router_scale=2.0,
        description="DeepSeek-V3: MoEGate with group-limited sigmoid routing, dense layer 0",
    ),
    "tiny-gpt_oss": Preset(
        "tiny-gpt_oss",
        {
            "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 16,
            "num_experts_per_tok": 4, "hidden_size": _TINY, "intermediate_size": 64,
            "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
            "sliding_window": 16, "rope_theta": 150000,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        description="gpt-oss: mlp.experts with linear biases and the clamped SwiGLU",
    ),
    "tiny-olmoe": Preset(
        "tiny-olmoe",
        {
            "model_type": "olmoe", "hidden_size": _TINY, "num_hidden_layers": 3,
            "intermediate_size": 64, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
            "num_experts": 16, "num_experts_per_tok": 4,
        },
        description="OLMoE: tied embeddings, 16 experts, top-4",
    ),
    "tiny-deepseek_v2": Preset(
        "tiny-deepseek_v2", _deepseek_v2(4, _TINY, 16, 4, 64, shared=2, dense=1),
        description="DeepSeek-V2: MLA attention, two shared experts, dense layer 0",
    ),
    # Many experts, top-8: prefill chunks of 8-64 tokens cross every row threshold of
    # MLX's kernel choice (8, 16, 64 rows; 4 x the experts of stock and of small pools).
    "thresholds-qwen3_moe": Preset(
        "thresholds-qwen3_moe",
        {
            "model_type": "qwen3_moe", "hidden_size": _TINY, "num_hidden_layers": 3,
            "intermediate_size": 2 * _TINY, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_experts": 128,
            "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "moe_intermediate_size": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "max_position_embeddings": 8192,
            "norm_topk_prob": True,
        },
        description="Qwen3-MoE with 128 experts, top-8 (kernel thresholds)",
    ),
    # A dense model: nothing to stream (tests that it is refused with a clear error).
    "tiny-llama-dense": Preset(
        "tiny-llama-dense",
        {
            "model_type": "llama", "hidden_size": _TINY, "num_hidden_layers": 2,
            "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        },
        description="a dense Llama: not a MoE, cannot be streamed",
    ),
    # The default demo model: Qwen3-Next architecture, small enough for a laptop CPU.
    "demo": Preset(
        "demo", _qwen3_next(8, 256, 32, 4, 128, mlp_only=()),
        description="Qwen3-Next shape, 8 layers, 32 experts top-4, float32 (CPU friendly)",
    ),
    # DeepSeek-V2-Lite's routing shape (27 layers, first dense; 64 experts, top-6, two
    # shared), to replay the DeepSeek-V2-Lite trace. Width scaled down for the CPU.
    "dsv2-lite-cpu": Preset(
        "dsv2-lite-cpu", _deepseek_v2(27, 768, 64, 6, 384), popularity=0.0,
        description="DeepSeek-V2-Lite routing shape, hidden 768, expert width 384, float32",
    ),
    # The same at full width (hidden 2048, expert width 1408, bf16): 4.87 MB per expert.
    "dsv2-lite": Preset(
        "dsv2-lite", _deepseek_v2(27, 2048, 64, 6, 1408, intermediate_size=10944,
                                  num_attention_heads=16, num_key_value_heads=16,
                                  kv_lora_rank=512, qk_rope_head_dim=64,
                                  qk_nope_head_dim=128, v_head_dim=128),
        dtype="bfloat16", popularity=0.0,
        description="DeepSeek-V2-Lite shape at full width, bf16 (GPU benchmarks)",
    ),
    # Qwen3-Next-80B-A3B expert shape (512 experts, top-10, hidden 2048, width 512);
    # the layer count is chosen at build time (num_layers=...).
    "qwen3-next-80b-shape": Preset(
        "qwen3-next-80b-shape",
        _qwen3_next(12, 2048, 512, 10, 512, num_attention_heads=16,
                    num_key_value_heads=2, head_dim=256, linear_num_value_heads=32,
                    linear_num_key_heads=16, linear_key_head_dim=128,
                    linear_value_head_dim=128, intermediate_size=5120),
        dtype="bfloat16", popularity=0.0,
        description="Qwen3-Next-80B-A3B expert shape, bf16 (GPU benchmarks)",
    ),
}

TINY_ARCHS = [n for n in PRESETS if n.startswith("tiny-") and "dense" not in n]


def build_tokenizer(vocab_size: int = 512):
    """A deterministic byte-level BPE tokenizer with a ChatML-style chat template."""
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
    tok.train_from_iterator(_CORPUS * 4, trainer)
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


class _Capture(nn.Module):
    """Stands in for an expert module during calibration and keeps its input's mean."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.sum, self.n = None, 0

    def __call__(self, x, indices):
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        s = flat.sum(axis=0)
        self.sum = s if self.sum is None else self.sum + s
        self.n += flat.shape[0]
        return self.inner(x, indices)


def _popularity(model: nn.Module, sites, tokenizer, seed: int, spread: float = 1.0) -> None:
    """Make some experts more popular in routers that have no bias of their own.

    Adds to each expert's router row a multiple of the mean direction ``u`` of the layer's
    inputs, scaled so that its logit moves by ``b_e ~ N(0, spread)`` on an average input.
    """
    ids = mx.array(tokenizer.encode(" ".join(_CORPUS)))[None]
    caps = {}
    for s in sites:
        caps[s.layer] = _Capture(s.module)
        s.parent.update_modules({s.attr: caps[s.layer]})
    mx.eval(model(ids))
    key = mx.random.key(seed + 2)
    for s in sites:
        s.parent.update_modules({s.attr: s.module})
        m = caps[s.layer].sum / caps[s.layer].n
        norm2 = (m * m).sum()
        if s.router is None or norm2.item() == 0 or any(
                n in s.router for n in ("bias", "e_score_correction_bias")):
            continue
        k1, key = mx.random.split(key)
        b = mx.random.normal((s.num_experts, 1), key=k1) * spread
        w = s.router.weight
        s.router.weight = (w + b * m[None] / norm2).astype(w.dtype)


def _sites_or_none(model: nn.Module) -> list:
    """The model's expert sites; none for a dense model (used in tests of bad input)."""
    from .core.discovery import UnsupportedModelError, find_expert_sites

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
    from mlx_lm.utils import quantize_model, save_config, save_model

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

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(tmp, model, donate_model=True)
    save_config(config, tmp / "config.json")
    tokenizer.save_pretrained(str(tmp))
    with open(tmp / "synthetic.json", "w") as f:
        json.dump({"preset": p.name, "bits": bits, "group_size": group_size,
                   "dtype": dtype, "seed": seed, "description": p.description}, f, indent=2)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Total bytes of a checkpoint's safetensors files."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of a module's parameters."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
