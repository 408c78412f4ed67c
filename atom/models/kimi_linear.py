"""Kimi-Linear (moonshotai/Kimi-Linear-48B-A3B): hybrid KDA / MLA decoder with MoE.

Matches transformers' ``KimiLinearForCausalLM``. Parameter names are the
checkpoint's (what ``save_pretrained`` writes, which is also the original
release layout), except that ``block_sparse_moe`` is read into ``mlp``.

Block: ``h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h))``;
attn is KDA ("linear_attention") or MLA ("full_attention"), mlp is a dense
gated MLP ("dense") or routed + shared experts ("sparse").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from atom.layers.cache_spec import CacheSpec
from atom.layers.decoder import PreNormDecoderLayer
from atom.layers.kda import KimiDeltaAttention
from atom.layers.linear import Linear
from atom.layers.mla import MultiHeadLatentAttention
from atom.layers.moe import GatedMLP, SparseMoE, TopkRouter
from atom.layers.norm import RMSNorm


def _pick(cfg: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    """First present key among a field's spellings (transformers' attribute_map aliases)."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


@dataclass(frozen=True)
class KimiLinearArgs:
    """The config.json fields the model uses, resolved like transformers' KimiLinearConfig."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    n_shared_experts: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    num_nextn_predict_layers: int = 0  # MTP draft layers stored after the decoder layers

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> KimiLinearArgs:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Kimi-Linear with hidden_act={act!r} is not supported; only 'silu'")
        num_layers = int(cfg.get("num_hidden_layers", 27))
        linear = cfg.get("linear_attn_config") or {}
        return cls(
            vocab_size=int(cfg.get("vocab_size", 163840)),
            hidden_size=int(cfg.get("hidden_size", 2304)),
            intermediate_size=int(cfg.get("intermediate_size", 9216)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1024)),
            num_hidden_layers=num_layers,
            num_attention_heads=int(cfg.get("num_attention_heads", 32)),
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(cfg.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(cfg.get("qk_rope_head_dim", 64)),
            v_head_dim=int(_pick(cfg, ("v_head_dim",), 128)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            num_experts=int(_pick(cfg, ("num_experts", "num_local_experts"), 256)),
            num_experts_per_tok=int(_pick(cfg, ("num_experts_per_token", "num_experts_per_tok"), 8)),
            n_group=int(_pick(cfg, ("num_expert_group", "n_group"), 1)),
            topk_group=int(_pick(cfg, ("topk_group",), 1)),
            n_shared_experts=int(_pick(cfg, ("num_shared_experts", "n_shared_experts"), 1)),
            norm_topk_prob=bool(_pick(cfg, ("moe_renormalize", "norm_topk_prob"), True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.446)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            # linear_attn_config (the release's spelling) wins over the flat keys, as in transformers
            linear_num_heads=int(linear.get("num_heads", cfg.get("linear_num_heads", 32))),
            linear_head_dim=int(linear.get("head_dim", cfg.get("linear_head_dim", 128))),
            linear_conv_kernel_dim=int(linear.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim", 4))),
            layer_types=_layer_types(cfg, linear, num_layers),
            mlp_layer_types=_mlp_layer_types(cfg, num_layers),
            num_nextn_predict_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        )

    def with_mtp_layers(self) -> KimiLinearArgs:
        """Layer types extended over the MTP layers: MLA attention, MoE when there are experts."""
        n = self.num_nextn_predict_layers
        mlp = "sparse" if self.num_experts > 0 else "dense"
        return replace(self, layer_types=self.layer_types + ("full_attention",) * n,
                       mlp_layer_types=self.mlp_layer_types + (mlp,) * n)


def _layer_types(cfg: dict[str, Any], linear: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """layer_types > linear_attn_config's 1-based kda_layers/full_attn_layers > MLA every 4th layer from 4."""
    if cfg.get("layer_types") is not None:
        types = list(cfg["layer_types"])
    elif "kda_layers" in linear and "full_attn_layers" in linear:
        types = [None] * num_layers
        for n in linear["full_attn_layers"]:
            types[n - 1] = "full_attention"
        for n in linear["kda_layers"]:
            types[n - 1] = "linear_attention"
    else:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    bad = [i for i, t in enumerate(types) if t not in ("linear_attention", "full_attention")]
    if len(types) != num_layers or bad:
        raise ValueError(
            f"config.json gives layer types {types} for {num_layers} layers; every layer needs "
            "'linear_attention' or 'full_attention' (check linear_attn_config.kda_layers/full_attn_layers)"
        )
    return tuple(types)


def _mlp_layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    if cfg.get("mlp_layer_types") is not None:
        types = tuple(cfg["mlp_layer_types"])
    else:
        dense = int(cfg.get("first_k_dense_replace", 1))
        types = tuple("dense" if i < dense else "sparse" for i in range(num_layers))
    if len(types) != num_layers or set(types) - {"dense", "sparse"}:
        raise ValueError(f"config.json mlp_layer_types {list(types)} must give 'dense' or 'sparse' for each layer")
    return types


class KimiLinearDecoderLayer(PreNormDecoderLayer):
    def __init__(self, args: KimiLinearArgs, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = _attention(args, layer_idx, dtype)
        self.mlp = _feed_forward(args, layer_idx, dtype)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype)


def _attention(args: KimiLinearArgs, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    if args.layer_types[layer_idx] == "linear_attention":
        return KimiDeltaAttention(
            args.hidden_size,
            args.linear_num_heads,
            args.linear_head_dim,
            args.linear_conv_kernel_dim,
            args.rms_norm_eps,
            layer_idx,
            dtype,
        )
    return MultiHeadLatentAttention(
        args.hidden_size,
        args.num_attention_heads,
        args.q_lora_rank,
        args.kv_lora_rank,
        args.qk_nope_head_dim,
        args.qk_rope_head_dim,
        args.v_head_dim,
        args.attention_bias,
        layer_idx,
        dtype,
    )


def _feed_forward(args: KimiLinearArgs, layer_idx: int, dtype: torch.dtype) -> nn.Module:
    if args.mlp_layer_types[layer_idx] == "dense":
        return GatedMLP(args.hidden_size, args.intermediate_size, dtype)
    router = TopkRouter(
        args.hidden_size,
        args.num_experts,
        args.num_experts_per_tok,
        args.n_group,
        args.topk_group,
        args.norm_topk_prob,
        args.routed_scaling_factor,
    )
    return SparseMoE(
        args.hidden_size, args.moe_intermediate_size, args.num_experts, args.n_shared_experts, router, dtype
    )


class KimiMTPLayer(KimiLinearDecoderLayer):
    """DeepSeek-V3-style multi-token-prediction layer (``model.layers.{N + i}``).

    ``h' = block(eh_proj([enorm(embed(next_token)); hnorm(h)]))``, logits from
    ``lm_head(shared_head.norm(h'))``. ``h`` is the target's final (normed) hidden
    state at the same position, or the previous MTP output when chaining.
    """

    def __init__(self, args: KimiLinearArgs, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__(args, layer_idx, dtype)
        d = args.hidden_size
        self.enorm = RMSNorm(d, args.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(d, args.rms_norm_eps, dtype=dtype)
        self.eh_proj = Linear(2 * d, d, bias=False, dtype=dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, args.rms_norm_eps, dtype=dtype)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous)], dim=-1))
        return super().forward(positions, x)


class KimiLinearModel(nn.Module):
    def __init__(self, args: KimiLinearArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_hidden_layers = args.num_hidden_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        layers = [KimiLinearDecoderLayer(args, i, dtype) for i in range(args.num_hidden_layers)]
        mtp_args = args.with_mtp_layers()
        layers += [KimiMTPLayer(mtp_args, args.num_hidden_layers + i, dtype)
                   for i in range(args.num_nextn_predict_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, delta = self.embed_tokens(input_ids), None
        for layer in self.layers[: self.num_hidden_layers]:
            hidden_states, delta = layer.forward_residual(positions, hidden_states, delta)
        return self.norm(hidden_states) if delta is None else self.norm.forward_add(hidden_states, delta)[0]


class KimiLinearForCausalLM(nn.Module):
    """Flat-batch model: ``forward(input_ids [T], positions [T]) -> hidden [T, D]``.

    Per-step batch layout and caches come from the forward context. The
    lm_head is never tied to the embedding: transformers' Kimi-Linear ties
    nothing, whatever ``tie_word_embeddings`` says.
    """

    # with the atom._C kernels its pure-decode forward has no host sync (atom.worker.cuda_graph)
    supports_cuda_graphs = True

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        self.args = KimiLinearArgs.from_hf(hf_config)
        self.dtype = dtype
        self.model = KimiLinearModel(self.args, dtype)
        self.lm_head = Linear(self.args.hidden_size, self.args.vocab_size, bias=False, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [T, V]; written into ``out`` [T, V] where given."""
        logits = self.lm_head(hidden_states)
        return logits.float() if out is None else out.copy_(logits)

    def graph_capturable(self, tokens: int) -> bool:
        """Whether a decode or verification step of this many tokens makes no host sync (atom.worker.cuda_graph):
        with the atom._C kernels only the MoE layers' path depends on the token count."""
        return all(layer.mlp.capturable(tokens) for layer in self.model.layers if isinstance(layer.mlp, SparseMoE))

    @property
    def num_mtp_layers(self) -> int:
        return self.args.num_nextn_predict_layers

    def _mtp_layer(self, depth: int) -> KimiMTPLayer:
        # more drafts than MTP layers: the last layers are reused, as DeepSeek-V3 serving does
        return self.model.layers[self.args.num_hidden_layers + depth % self.num_mtp_layers]

    def mtp_forward(self, input_ids, positions, previous_hidden, depth: int) -> torch.Tensor:
        """One MTP step over a flat batch: next tokens + the hidden states they follow."""
        return self._mtp_layer(depth)(positions, self.model.embed_tokens(input_ids), previous_hidden)

    def mtp_logits(self, hidden_states: torch.Tensor, depth: int) -> torch.Tensor:
        return self.lm_head(self._mtp_layer(depth).shared_head.norm(hidden_states)).float()

    def cache_specs(self) -> dict[int, CacheSpec]:
        """MLASpec for MLA layers, RecurrentStateSpec for KDA layers."""
        return {i: layer.self_attn.cache_spec() for i, layer in enumerate(self.model.layers)}

    def hf_name_map(self, name: str) -> str | None:
        return name.replace(".block_sparse_moe.", ".mlp.")

    def dummy_init(self, name: str, param: torch.Tensor, generator: torch.Generator) -> bool:
        """Random KDA parameters for load_format="dummy" (the loader fills the rest): the decay's A_log and
        dt_bias as transformers initialises them (exp(A_log) in [1, 16]; softplus(dt_bias) in [1e-3, 0.1]),
        the short convolutions as torch's Conv1d does (uniform within 1/sqrt(kernel size))."""
        if name.endswith(".A_log"):
            param.uniform_(1.0, 16.0, generator=generator).log_()
        elif name.endswith(".dt_bias"):
            dt = param.uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp_()
            param.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
        elif name.endswith("_conv1d.weight"):
            bound = param.shape[-1] ** -0.5
            param.uniform_(-bound, bound, generator=generator)
        else:
            return False
        return True

    def post_load(self) -> None:
        for layer in self.model.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.fuse()
            elif isinstance(layer.mlp, GatedMLP):
                layer.mlp.gate_up.stack()
            if isinstance(layer.self_attn, KimiDeltaAttention):
                layer.self_attn.fuse_conv_weights()
            elif isinstance(layer.self_attn, MultiHeadLatentAttention):
                layer.self_attn.stack_projections()
