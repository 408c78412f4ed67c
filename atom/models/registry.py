"""Architecture name (config.json ``architectures[0]``) -> model class."""

from __future__ import annotations

import importlib

_MODELS = {
    "KimiLinearForCausalLM": ("atom.models.kimi_linear", "KimiLinearForCausalLM"),
    "LlamaForCausalLM": ("atom.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("atom.models.llama", "Qwen3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str):
    if architecture not in _MODELS:
        raise ValueError(
            f"architecture {architecture!r} is not supported; ATOM runs: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
