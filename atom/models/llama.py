"""Llama and Qwen3 decoder-only models over a paged KV cache.

Parameter names equal the tensor names transformers' ``save_pretrained`` writes
(``model.layers.N.self_attn.q_proj.weight``, ...), so checkpoints load 1:1.
Qwen3 is Llama plus a per-head RMSNorm on q and k (over head_dim, before rope).
The forward pass runs on a flat batch: all sequences' new tokens of one step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.layers.attention import Attention
from atom.layers.cache_spec import PagedKVSpec
from atom.layers.decoder import PreNormDecoderLayer
from atom.layers.linear import Linear, StackedLinears
from atom.layers.moe import GatedMLP
from atom.layers.norm import RMSNorm
from atom.layers.rotary import RotaryEmbedding, rope_parameters


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool, dtype):
        super().__init__()
        hidden, heads, kv_heads = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = head_dim = _head_dim(cfg)
        bias = bool(cfg.get("attention_bias", False))
        self.q_proj = Linear(hidden, heads * head_dim, bias=bias, dtype=dtype)
        self.k_proj = Linear(hidden, kv_heads * head_dim, bias=bias, dtype=dtype)
        self.v_proj = Linear(hidden, kv_heads * head_dim, bias=bias, dtype=dtype)
        self.qkv = StackedLinears(self.q_proj, self.k_proj, self.v_proj)  # one matmul; stack() after loading
        self.o_proj = Linear(heads * head_dim, hidden, bias=bias, dtype=dtype)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, cfg["rms_norm_eps"], dtype)
            self.k_norm = RMSNorm(head_dim, cfg["rms_norm_eps"], dtype)
        self.qk_norm = qk_norm
        self.attn = Attention(heads, kv_heads, head_dim, head_dim**-0.5, layer_idx, rotary)  # rotary: shared

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv.split(hidden_states)
        if self.qk_norm:
            shape = (hidden_states.shape[0], -1, self.head_dim)
            q, k = self.q_norm(q.reshape(shape)), self.k_norm(k.reshape(shape))
        return self.o_proj(self.attn(positions, q, k, v))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: dict[str, Any], layer_idx: int, rotary: RotaryEmbedding, qk_norm: bool, dtype):
        super().__init__()
        eps = cfg["rms_norm_eps"]
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary, qk_norm, dtype)
        mlp_bias = bool(cfg.get("mlp_bias", False))
        self.mlp = GatedMLP(cfg["hidden_size"], cfg["intermediate_size"], dtype, bias=mlp_bias)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps, dtype)


class LlamaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], qk_norm: bool, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], dtype=dtype)
        self.rotary_emb = RotaryEmbedding(_head_dim(cfg), rope_parameters(cfg))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, self.rotary_emb, qk_norm, dtype) for i in range(cfg["num_hidden_layers"])
        )
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"], dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, delta = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, delta = layer.forward_residual(positions, hidden_states, delta)
        return self.norm(hidden_states) if delta is None else self.norm.forward_add(hidden_states, delta)[0]


def _check_supported(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported; ATOM's Llama MLP implements 'silu' only")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ()):
        raise ValueError("sliding-window attention layers are not supported; set use_sliding_window=false")


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM; see the module docstring for the batch layout."""

    qk_norm = False
    # with the atom._C kernels, decode attends with paged_decode_attention (atom/layers/attention.py)
    supports_cuda_graphs = True

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype):
        super().__init__()
        _check_supported(hf_config)
        self.hf_config = hf_config
        self.dtype = dtype
        self.model = LlamaModel(hf_config, self.qk_norm, dtype)
        self.lm_head = Linear(hf_config["hidden_size"], hf_config["vocab_size"], bias=False, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [T, V]; written into ``out`` [T, V] where given."""
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def graph_capturable(self, tokens: int) -> bool:
        """A decode or verification step of any size makes no host sync with the atom._C kernels
        (atom.worker.cuda_graph)."""
        return True

    def cache_specs(self) -> dict[int, PagedKVSpec]:
        return {i: layer.self_attn.attn.kv_cache_spec(self.dtype) for i, layer in enumerate(self.model.layers)}

    def hf_name_map(self, name: str) -> str | None:
        # Older checkpoints may carry the (recomputed) rotary inverse frequencies.
        return None if name.endswith("rotary_emb.inv_freq") else name

    def tie_weights(self) -> set[str]:
        if not self.hf_config.get("tie_word_embeddings", False):
            return set()
        self.lm_head.weight = self.model.embed_tokens.weight
        return {"lm_head.weight"}

    def post_load(self) -> None:
        self.model.rotary_emb.post_load()
        for layer in self.model.layers:
            layer.self_attn.qkv.stack()
            layer.mlp.gate_up.stack()


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama with q_norm/k_norm per head and an explicit head_dim."""

    qk_norm = True
