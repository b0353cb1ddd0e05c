"""Option helpers every method shares: `--opt` strings converted to a field's type, the checks `__post_init__` runs
(errors in the style of transformers' cache options, naming what is allowed), and a model's KV layout."""

from __future__ import annotations

from kvzip.errors import UserError

KERNELS = ("auto", "torch")  # a method's `kernel` option: the fused CPU kernels where they run (kvzip/kernels), or never


def convert_option(raw: str, kind, label: str):
    try:
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind in (int, float, str):
            return kind(raw)
    except ValueError:
        raise UserError(f"option {label}={raw!r} is not a valid {kind.__name__}") from None
    raise UserError(f"option {label} has an unsupported type {kind}")


def check_choice(name: str, value, allowed) -> None:
    """Raise ValueError naming the allowed values (the error style of transformers' cache options)."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; use one of: {', '.join(map(str, allowed))}")


def check_positive(**values) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def model_layout(model) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers causal LM."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim
