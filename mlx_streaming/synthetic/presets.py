"""Recipes of synthetic checkpoints: an mlx-lm config plus quantization and dtype, one
tiny preset per supported architecture (tests), and benchmark shapes (DeepSeek-V2-Lite,
Qwen3-Next-80B-A3B)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
            "type": "yarn",
            "factor": 40,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
    }
    cfg.update(kw)
    return cfg


_TINY = 128  # hidden size of the per-architecture test presets

PRESETS: dict[str, Preset] = {
    # One tiny preset per supported architecture, for tests. Dense layers sit between
    # MoE layers where the architecture allows it.
    # Qwen3-Next's shared expert is as wide as an expert: 128, not 64, since MLX CUDA
    # 0.32.4's dense quantized matmul reads unwritten memory (NaN) when its input is one
    # quantization group wide, at most row counts from 2 on (benchmarks/probes/cuda_qmm_nan.py).
    "tiny-qwen3_next": Preset(
        "tiny-qwen3_next",
        _qwen3_next(4, _TINY, 16, 4, 128, mlp_only=(1,)),
        description="Qwen3-Next: linear + full attention, shared expert, a dense layer 1",
    ),
    "tiny-qwen3_moe": Preset(
        "tiny-qwen3_moe",
        {
            "model_type": "qwen3_moe",
            "hidden_size": _TINY,
            "num_hidden_layers": 4,
            "intermediate_size": 2 * _TINY,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [0],
            "moe_intermediate_size": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 8192,
            "norm_topk_prob": True,
        },
        description="Qwen3-MoE with a dense first layer",
    ),
    "tiny-mixtral": Preset(
        "tiny-mixtral",
        {
            "model_type": "mixtral",
            "hidden_size": _TINY,
            "num_hidden_layers": 3,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6,
        },
        description="Mixtral: block_sparse_moe.switch_mlp, 8 experts, top-2",
    ),
    "tiny-deepseek_v3": Preset(
        "tiny-deepseek_v3",
        {
            "model_type": "deepseek_v3",
            "vocab_size": 512,
            "hidden_size": _TINY,
            "intermediate_size": 2 * _TINY,
            "moe_intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 16,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 32,
            "q_lora_rank": 64,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "qk_nope_head_dim": 32,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 4,
            "moe_layer_freq": 1,
            "first_k_dense_replace": 1,
            "max_position_embeddings": 8192,
        },
        router_scale=2.0,
        description="DeepSeek-V3: MoEGate with group-limited sigmoid routing, dense layer 0",
    ),
    "tiny-gpt_oss": Preset(
        "tiny-gpt_oss",
        {
            "model_type": "gpt_oss",
            "num_hidden_layers": 4,
            "num_local_experts": 16,
            "num_experts_per_tok": 4,
            "hidden_size": _TINY,
            "intermediate_size": 64,
            "head_dim": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "sliding_window": 16,
            "rope_theta": 150000,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        description="gpt-oss: mlp.experts with linear biases and the clamped SwiGLU",
    ),
    "tiny-olmoe": Preset(
        "tiny-olmoe",
        {
            "model_type": "olmoe",
            "hidden_size": _TINY,
            "num_hidden_layers": 3,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "rms_norm_eps": 1e-5,
            "num_experts": 16,
            "num_experts_per_tok": 4,
        },
        description="OLMoE: tied embeddings, 16 experts, top-4",
    ),
    "tiny-deepseek_v2": Preset(
        "tiny-deepseek_v2",
        _deepseek_v2(4, _TINY, 16, 4, 64, shared=2, dense=1),
        description="DeepSeek-V2: MLA attention, two shared experts, dense layer 0",
    ),
    # The DeepSeek-V2-Lite trace's routing shape (64 experts, top-6) in 3 tiny MoE layers:
    # replays the trace in tests.
    "trace-deepseek_v2": Preset(
        "trace-deepseek_v2",
        _deepseek_v2(4, _TINY, 64, 6, 64),
        popularity=0.0,
        description="DeepSeek-V2-Lite routing shape (64 experts, top-6), tiny widths",
    ),
    # Many experts, top-8: prefill chunks of 8-64 tokens cross every row threshold of
    # MLX's kernel choice (8, 16, 64 rows; 4 x the experts of stock and of small pools).
    "thresholds-qwen3_moe": Preset(
        "thresholds-qwen3_moe",
        {
            "model_type": "qwen3_moe",
            "hidden_size": _TINY,
            "num_hidden_layers": 3,
            "intermediate_size": 2 * _TINY,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
            "max_position_embeddings": 8192,
            "norm_topk_prob": True,
        },
        description="Qwen3-MoE with 128 experts, top-8 (kernel thresholds)",
    ),
    # A dense model: nothing to stream (tests that it is refused with a clear error).
    "tiny-llama-dense": Preset(
        "tiny-llama-dense",
        {
            "model_type": "llama",
            "hidden_size": _TINY,
            "num_hidden_layers": 2,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        },
        description="a dense Llama: not a MoE, cannot be streamed",
    ),
    # The default demo model: Qwen3-Next architecture, small enough for a laptop CPU.
    "demo": Preset(
        "demo",
        _qwen3_next(8, 256, 32, 4, 128, mlp_only=()),
        description="Qwen3-Next shape, 8 layers, 32 experts top-4, float32 (CPU friendly)",
    ),
    # DeepSeek-V2-Lite's routing shape (27 layers, first dense; 64 experts, top-6, two
    # shared), to replay the DeepSeek-V2-Lite trace. Width scaled down for the CPU.
    "dsv2-lite-cpu": Preset(
        "dsv2-lite-cpu",
        _deepseek_v2(27, 768, 64, 6, 384),
        popularity=0.0,
        description="DeepSeek-V2-Lite routing shape, hidden 768, expert width 384, float32",
    ),
    # The same at full width (hidden 2048, expert width 1408, bf16): 4.87 MB per expert.
    "dsv2-lite": Preset(
        "dsv2-lite",
        _deepseek_v2(
            27,
            2048,
            64,
            6,
            1408,
            intermediate_size=10944,
            num_attention_heads=16,
            num_key_value_heads=16,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
        dtype="bfloat16",
        popularity=0.0,
        description="DeepSeek-V2-Lite shape at full width, bf16 (GPU benchmarks)",
    ),
    # Qwen3-Next-80B-A3B expert shape (512 experts, top-10, hidden 2048, width 512);
    # the layer count is chosen at build time (num_layers=...).
    "qwen3-next-80b-shape": Preset(
        "qwen3-next-80b-shape",
        _qwen3_next(
            12,
            2048,
            512,
            10,
            512,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=256,
            linear_num_value_heads=32,
            linear_num_key_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            intermediate_size=5120,
        ),
        dtype="bfloat16",
        popularity=0.0,
        description="Qwen3-Next-80B-A3B expert shape, bf16 (GPU benchmarks)",
    ),
}

TINY_ARCHS = [n for n in PRESETS if n.startswith("tiny-") and "dense" not in n]
