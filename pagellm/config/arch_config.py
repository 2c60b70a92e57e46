"""The architecture half of a model's config (config.json keys) as plain attributes.

Model code reads `config.hidden_size`, `getattr(config, "head_dim", None)` and the like.
A transformers PretrainedConfig answers the same questions, but importing its classes
costs seconds and unpickling one in the engine process imports transformers again; this
object is a dict with attribute access, cheap to build and to send.
"""

from __future__ import annotations

from typing import Any

# Values transformers' LlamaConfig would supply for keys a config.json or GGUF omits.
_DEFAULTS: dict[str, Any] = {
    "architectures": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "num_key_value_heads": None,
    "head_dim": None,
    "sliding_window": None,
    "dtype": None,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}


class ArchConfig:
    """`ArchConfig({"hidden_size": 576, ...}).hidden_size == 576`; keys neither given nor
    defaulted raise AttributeError, so `getattr(config, key, default)` works as usual."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(_DEFAULTS)
        self.__dict__.update(values)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ArchConfig) and other.__dict__ == self.__dict__

    def __repr__(self) -> str:
        keys = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")
        return "ArchConfig(" + ", ".join(f"{k}={self.__dict__.get(k)!r}" for k in keys) + ")"


def head_dim_of(config: Any) -> int:
    """Per-head size: config.head_dim where given (Qwen3, Gemma), else hidden / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    """KV heads: num_key_value_heads where given (GQA), else one per attention head."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def rope_dict(config: Any) -> dict[str, Any]:
    """The rope settings of either config style: rope_parameters, else rope_scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if not params.get("rope_type") and isinstance(scaling, dict):
        params.update(scaling)
    return params


def context_length(config: Any, default: int) -> int:
    """Positions the model takes: max_position_embeddings (else `default`), stretched by
    the factor of linear rope scaling, as vLLM reads such configs (LongChat: 2048 x 8)."""
    limit = int(getattr(config, "max_position_embeddings", None) or default)
    params = rope_dict(config)
    if params.get("rope_type", params.get("type")) == "linear" and params.get("factor"):
        limit = int(limit * params["factor"])
    return limit
