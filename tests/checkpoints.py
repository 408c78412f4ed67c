"""Small random Hugging Face checkpoints for tests, saved with save_pretrained.

Each factory seeds torch, builds the transformers model, and writes fp32
weights plus (optionally) a small BPE tokenizer into a folder.
"""

from __future__ import annotations

import torch

from atom.tokenizer_builder import build_tokenizer

VOCAB = 320  # matches the tokenizer built by build_tokenizer(vocab_size=320)


def _tune_kda_decay(model) -> None:
    # HF's init draws A_log in log[1, 16], which forgets almost everything each token;
    # a slower decay makes the recurrent state matter across many tokens.
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            with torch.no_grad():
                p.uniform_(-3.0, 0.0)


KIMI_VARIANTS = {
    # KDA/MLA pattern via layer_types; dense first layer, MoE after.
    "kda_mla": dict(
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=4, linear_num_heads=2, linear_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
    ),
    # Original checkpoint spelling: 1-based kda/full layer lists.
    "checkpoint_spelling": dict(
        num_hidden_layers=3,
        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2], "head_dim": 8, "num_heads": 4,
                            "short_conv_kernel_size": 4},
        num_attention_heads=2, num_local_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=0,
    ),
    # MLA first, q_lora, more experts, two dense layers.
    "mla_first_qlora": dict(
        num_hidden_layers=4,
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2, linear_num_heads=4, linear_head_dim=8, q_lora_rank=24,
        num_local_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        mlp_layer_types=["dense", "dense", "sparse", "sparse"],
    ),
    # Only KDA layers plus one MLA at the end, shared experts x2.
    "kda_heavy": dict(
        num_hidden_layers=5,
        layer_types=["linear_attention"] * 4 + ["full_attention"],
        num_attention_heads=4, linear_num_heads=2, linear_head_dim=32, n_shared_experts=2,
        num_local_experts=6, num_experts_per_tok=3, n_group=1, topk_group=1, first_k_dense_replace=2,
    ),
}


def make_kimi_checkpoint(path: str, variant: str = "kda_mla", tokenizer: bool = True, seed: int = 0,
                         **overrides) -> str:  # fmt: skip
    """A random Kimi-Linear checkpoint of ``variant``; ``overrides`` replace config fields (e.g. MLA's head sizes)."""
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        routed_scaling_factor=1.5, tie_word_embeddings=False,
    )
    kw.update(KIMI_VARIANTS[variant])
    kw.update(overrides)
    torch.manual_seed(seed)
    config = KimiLinearConfig(**kw)
    model = KimiLinearForCausalLM(config).eval()
    _tune_kda_decay(model)
    model.save_pretrained(path)
    if tokenizer:
        build_tokenizer(path, VOCAB)
    return path


def make_llama_checkpoint(path: str, kind: str = "llama", tokenizer: bool = True, seed: int = 0,
                          head_dim: int | None = None) -> str:  # fmt: skip
    """A random Llama or Qwen3 checkpoint: hidden 64, 4 query heads and 2 kv heads of head_dim (by default 16
    for Llama, hidden / heads, and 24 for Qwen3)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        dims = {} if head_dim is None else {"head_dim": head_dim}
        model = LlamaForCausalLM(LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **dims, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim or 24,
                                             tie_word_embeddings=True, **common))
    model.eval().save_pretrained(path)
    if tokenizer:
        build_tokenizer(path, VOCAB)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding), EOS not special; new tokens only.
    ``generate_kwargs`` go to ``generate`` (e.g. repetition_penalty)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0, **generate_kwargs)
            outs.append(out[0, len(ids):].tolist())
    return outs


def hf_prompt_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position, [len(ids), vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def add_mtp_weights(path: str, num_layers: int = 1, seed: int = 1) -> str:
    """Give a Kimi-Linear checkpoint DeepSeek-V3-layout MTP layers (random weights).

    Transformers has no Kimi MTP, so the tensors come from atom's own module
    definition: ``model.layers.{N + i}.{enorm,hnorm,eh_proj,shared_head.norm,...}``
    in an extra safetensors file, and ``num_nextn_predict_layers`` in config.json.
    """
    import json
    import os

    from safetensors.torch import save_file

    from atom.models.kimi_linear import KimiLinearForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = num_layers
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(cfg, torch.float32)
    first = f"model.layers.{model.args.num_hidden_layers}."
    tensors = {}
    for name, p in model.named_parameters():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer < model.args.num_hidden_layers:
            continue
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones_like(p)
        elif name.endswith("e_score_correction_bias"):
            t = torch.zeros_like(p)
        else:
            t = torch.randn_like(p) * 0.1
        tensors[name] = t.contiguous()
    assert any(n.startswith(first) for n in tensors)
    save_file(tensors, os.path.join(path, "model-mtp.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return path
