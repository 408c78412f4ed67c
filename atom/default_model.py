"""The bundled default model: a small random Kimi-Linear checkpoint, built offline.

``atom-engine`` runs without ``--model`` on a fresh machine with no hub
access, so the default model is generated, not downloaded: a
Kimi-Linear-shaped hybrid (KDA + MLA layers, MoE) with seeded random weights
and a small byte-level BPE tokenizer. Its text is gibberish by construction;
it exists to show the engine working end to end.

The folder is built once into ``$ATOM_CACHE_DIR/<name>`` (default
``~/.cache/atom/<name>``) and reused. It is built in a temporary sibling
folder and renamed into place, so concurrent first uses never see a half
written checkpoint. The same code and torch version give the same bytes;
bump ``_NAME`` whenever the config or the weight recipe changes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import zlib

import torch

_NAME = "default-kimi-linear-v1"
_SEED = 1234
_INIT_STD = 0.02
_VOCAB = 512  # the tokenizer's vocabulary size; ids 0/1/2 are <pad>/<s>/</s>

# Written with the keys transformers' save_pretrained uses for KimiLinearConfig,
# so transformers can load the folder as well as ATOM.
CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "dtype": "float32",
    "vocab_size": _VOCAB,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 6,
    "layer_types": [
        "linear_attention", "linear_attention", "full_attention",
        "linear_attention", "linear_attention", "full_attention",
    ],
    "first_k_dense_replace": 1,
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse", "sparse", "sparse"],
    # KDA
    "linear_num_heads": 4,
    "linear_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    # MLA
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "qk_head_dim": 48,
    "head_dim": 16,
    "v_head_dim": 32,
    "attention_bias": False,
    "attention_dropout": 0.0,
    # MoE
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_expert_group": 1,
    "topk_group": 1,
    "num_shared_experts": 1,
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "output_router_logits": False,
    # the rest
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "initializer_range": _INIT_STD,
    "model_max_length": 4096,
    "tie_word_embeddings": False,
    "use_cache": True,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def cache_root() -> str:
    return os.environ.get("ATOM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "atom")


def default_model_path() -> str:
    """The default checkpoint folder, built on first use (a second or two on CPU)."""
    root = cache_root()
    path = os.path.join(root, _NAME)
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{_NAME}.", dir=root)
    try:
        build_default_model(tmp)
        try:
            os.replace(tmp, path)
        except OSError:
            # Another process renamed its copy into place first; theirs is identical.
            if not os.path.isfile(os.path.join(path, "model.safetensors")):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_default_model(path: str) -> None:
    """Write config.json, generation_config.json, model.safetensors and the tokenizer into ``path``."""
    from safetensors.torch import save_file

    from atom.tokenizer_builder import build_tokenizer

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2, sort_keys=True)
    generation = {key: CONFIG[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2, sort_keys=True)
    save_file(random_weights(), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer(path, _VOCAB)


def random_weights() -> dict[str, torch.Tensor]:
    """Seeded weights for every parameter of ATOM's model, under the checkpoint's tensor names."""
    from atom.models.kimi_linear import KimiLinearForCausalLM

    model = KimiLinearForCausalLM(CONFIG, torch.float32)
    tensors = {}
    for name, param in sorted(model.named_parameters()):
        # One generator per tensor, seeded by its name: values do not depend on parameter order.
        gen = torch.Generator().manual_seed(_SEED ^ zlib.crc32(name.encode()))
        # ATOM reads the checkpoint's `block_sparse_moe` as `mlp` (see KimiLinearForCausalLM.hf_name_map).
        hf_name = name.replace(".mlp.", ".block_sparse_moe.")
        tensors[hf_name] = _init(name, tuple(param.shape), param.dtype, gen)
    return tensors


def _init(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """transformers' KimiLinear init: normal(0.02) weights, unit norms, FLA-style decay parameters."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":  # log of uniform[1, 16]
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log().to(dtype)
    if leaf == "dt_bias":  # inverse softplus of dt, with dt log-uniform in [1e-3, 1e-1]
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)
    if leaf == "e_score_correction_bias":
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:  # RMSNorm weights
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape).normal_(0.0, _INIT_STD, generator=gen).to(dtype)
