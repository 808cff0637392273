"""How many parameters LoRA trains: the count behind a LoRA run's checkpoint size and window check.

A LoRA adapter on a linear layer of `in` inputs and `out` outputs adds A (r x in) and B (out x r):
r * (in + out) trainable parameters (peft's LoraLayer, no bias). In a Llama-style block the
linear layers and their shapes (LlamaAttention, LlamaMLP in transformers):

    q_proj  hidden -> heads * head_dim         o_proj     heads * head_dim -> hidden
    k_proj  hidden -> kv_heads * head_dim      gate_proj  hidden -> intermediate
    v_proj  hidden -> kv_heads * head_dim      up_proj    hidden -> intermediate
                                               down_proj  intermediate -> hidden

Import-light and pure: sizing.state_bytes uses it at CLI start-up.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping


def llama_linear_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear layer of one block, by module name. Raises ValueError for a bad config."""

    def number(name: str, default=None) -> int:
        value = config.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the model config's '{name}' must be a positive integer, got {value!r}")
        return value

    hidden, intermediate = number("hidden_size"), number("intermediate_size")
    heads = number("num_attention_heads")
    kv_heads = number("num_key_value_heads", heads)
    head_dim = number("head_dim", hidden // heads if hidden % heads == 0 else None)
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, intermediate),
        "up_proj": (hidden, intermediate),
        "down_proj": (intermediate, hidden),
    }


def trainable_params(config: Mapping[str, Any], r: int, target_modules: Iterable[str]) -> int:
    """Parameters LoRA of rank r trains on the target layers of every block. Raises ValueError for a
    target this count does not know (it covers the linear layers of a Llama-style block)."""
    shapes = llama_linear_shapes(config)
    layers = config.get("num_hidden_layers")
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise ValueError(f"the model config's 'num_hidden_layers' must be a positive integer, got {layers!r}")
    targets = list(dict.fromkeys(target_modules))
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(f"cannot count LoRA parameters on {', '.join(unknown)} (known: {', '.join(shapes)})")
    return layers * sum(r * (shapes[t][0] + shapes[t][1]) for t in targets)
