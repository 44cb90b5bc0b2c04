"""A model's sizes, read from its config.json without torch: enough to count its parameters and
its FLOPs per token (autotune.specs.flops) for the planner's speed model and for telling how long a
CPU run would take."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The model's sizes the cost model needs.

    `trainable_parameters` None: derived from the config (all of them for a full fine-tune, the
    LoRA adapters' estimate under --peft). `heads` None: hidden // HEAD_DIM_GUESS.
    """

    parameters: int
    layers: int
    hidden: int
    vocab: int
    heads: int | None = None
    trainable_parameters: int | None = None
    intermediate: int | None = None  # the MLP's width (None: 4 x hidden)
    kv_width: int | None = None  # K's and V's projections' width (grouped heads; None: hidden)
    gated: bool = False  # a gated MLP (SwiGLU, GeGLU): three matrices, not two
    model_type: str = ""
    attention_dropout: bool = False  # dropout on the attention's probabilities (BERT, GPT-2: 0.1; Llama: 0)
    rms_norm: bool = False  # RMSNorm (Llama, Mistral, Qwen, Gemma, T5), not LayerNorm

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """One layer's linear modules by role, (in, out) each: what LoRA adapts, and by name."""
        h, i, kv = self.hidden, self.intermediate or 4 * self.hidden, self.kv_width or self.hidden
        shapes = {"q": (h, h), "k": (h, kv), "v": (h, kv), "o": (h, h), "up": (h, i), "down": (i, h)}
        if self.gated:
            shapes["gate"] = (h, i)
        return shapes


# Module names (the last part, as LoRA's target_modules name them) -> the roles of linear_shapes().
# GPT-2's fused c_attn holds q, k and v; its c_proj is the attention's and the MLP's output.
LINEAR_ROLES: dict[str, tuple[str, ...]] = {
    "q_proj": ("q",),
    "query": ("q",),
    "q": ("q",),
    "k_proj": ("k",),
    "key": ("k",),
    "k": ("k",),
    "v_proj": ("v",),
    "value": ("v",),
    "v": ("v",),
    "o_proj": ("o",),
    "out_proj": ("o",),
    "o": ("o",),
    "dense": ("o",),
    "c_attn": ("q", "k", "v"),
    "qkv_proj": ("q", "k", "v"),
    "query_key_value": ("q", "k", "v"),
    "c_proj": ("o", "down"),
    "c_fc": ("up",),
    "fc1": ("up",),
    "fc2": ("down",),
    "up_proj": ("up",),
    "down_proj": ("down",),
    "gate_proj": ("gate",),
    "wi": ("up",),
    "wo": ("down",),
    "w1": ("gate",),
    "w2": ("down",),
    "w3": ("up",),
    "gate_up_proj": ("gate", "up"),
}


def adapted_linears(dims: ModelDims, targets: str) -> list[tuple[int, int]]:
    """The (in, out) of each linear module of one layer that LoRA adapters of `targets` (all-linear,
    or comma-separated module names) sit on; a name not known here counts as one hidden x hidden."""
    shapes = dims.linear_shapes()
    if targets == "all-linear":
        return list(shapes.values())
    found: list[tuple[int, int]] = []
    for name in (n.strip() for n in targets.split(",") if n.strip()):
        roles = LINEAR_ROLES.get(name.rsplit(".", 1)[-1])
        found += [shapes[r] for r in roles if r in shapes] if roles else [(dims.hidden, dims.hidden)]
    return found


# Read from config.json.
# Families whose MLP is gated (SwiGLU / GeGLU: three matrices instead of two).
_GATED = {
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma3_text",
    "phi3",
    "olmo",
    "olmo2",
    "granite",
    "cohere",
    "starcoder2",
    "internlm2",
    "deepseek_v2",
    "deepseek_v3",
    "smollm3",
    "exaone",
    "yi",
}
# Families with learned position embeddings (a max_positions x d table).
_LEARNED_POSITIONS = {
    "gpt2",
    "gpt_neo",
    "opt",
    "bert",
    "roberta",
    "distilbert",
    "xlm-roberta",
    "electra",
    "bart",
    "mbart",
    "biogpt",
}


def _first(config: dict, *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def dims_from_config(config: dict) -> ModelDims | None:
    """Sizes read from a config.json (torch-free), None where it lacks them: the parameter count
    from the usual transformer shapes (attention with grouped K/V heads, a plain or gated MLP,
    embeddings, tied or not; norms and biases left out, under 1%). Multimodal configs: their text
    model's. Mixture-of-experts models are not modelled: they count as one dense MLP."""
    text = config.get("text_config")
    if _first(config, "hidden_size", "n_embd", "d_model", "dim") is None and isinstance(text, dict):
        # The outer config's tying governs the model built (transformers reads it there) where it has one.
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
        config = {**text, "tie_word_embeddings": tied}
    hidden = _first(config, "hidden_size", "n_embd", "d_model", "dim") or 0
    heads = _first(config, "num_attention_heads", "n_head", "num_heads", "encoder_attention_heads")
    kv_heads = _first(config, "num_key_value_heads", "num_kv_heads", "multi_query_group_num") or heads
    head_dim = _first(config, "head_dim", "d_kv") or (hidden // heads if heads else hidden)
    ffn = _first(config, "intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim") or 4 * hidden
    vocab = _first(config, "vocab_size", "padded_vocab_size") or 0
    model_type = str(config.get("model_type", ""))
    gated = model_type in _GATED or str(config.get("feed_forward_proj", "")).startswith("gated")

    q = (heads or 1) * head_dim
    attention = hidden * q + 2 * hidden * (kv_heads or 1) * head_dim + q * hidden
    mlp = (3 if gated else 2) * hidden * ffn
    encoder = _first(config, "encoder_layers", "num_layers") if config.get("is_encoder_decoder") else None
    if encoder:
        decoder = _first(config, "decoder_layers", "num_decoder_layers") or encoder
        layers = encoder + decoder
        body = encoder * (attention + mlp) + decoder * (2 * attention + mlp)  # decoders add cross-attention
    else:
        layers = _first(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers") or 0
        body = layers * (attention + mlp)
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    if model_type in _LEARNED_POSITIONS:
        embeddings += (_first(config, "max_position_embeddings", "n_positions") or 0) * hidden
    if not (hidden and layers and vocab):
        return None
    return ModelDims(
        parameters=body + embeddings,
        layers=layers,
        hidden=hidden,
        vocab=vocab,
        heads=heads,
        intermediate=ffn,
        kv_width=(kv_heads or 1) * head_dim,
        gated=gated,
        model_type=model_type,
        attention_dropout=_attention_dropout(config) > 0,
        rms_norm="rms_norm_eps" in config or model_type in _RMS_NORM_WITHOUT_ITS_KEY,
    )


# Families whose norm is RMSNorm where a config.json leaves `rms_norm_eps` to its class's default,
# and T5's (T5LayerNorm: no mean subtracted, no bias; its epsilon is `layer_norm_epsilon`).
_RMS_NORM_WITHOUT_ITS_KEY = frozenset(
    {
        "llama",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
        "phi3",
        "olmo2",
        "t5",
        "mt5",
        "umt5",
        "longt5",
    }
)


def _attention_dropout(config: dict) -> float:
    """The dropout probability on attention's probabilities, by the names configs give it."""
    for key in ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop", "attention_dropout_prob"):
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0
