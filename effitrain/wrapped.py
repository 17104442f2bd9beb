"""What a lever's wrapper hides: a leaf module (no effitrain imports), so the optimizer registry's
builders can look through LoRA's peft wrapper without importing the levers."""

from __future__ import annotations

from typing import Any


def is_lora(model: Any) -> bool:
    """Whether ``model`` (unwrapped) is a peft model."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: Any) -> Any:
    """The transformers model under a lever's wrapper (LoRA's peft model), else ``model``."""
    return model.get_base_model() if is_lora(model) else model


def is_causal_lm(model: Any) -> bool:
    """Whether ``model`` (unwrapped, under LoRA or not) is a transformers causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(base_model(model)).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
