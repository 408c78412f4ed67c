"""Kimi Delta Attention (KDA) layer: gated delta rule with per-channel decay.

Parameter names follow the checkpoint (``q_conv1d``/``k_conv1d``/``v_conv1d``,
``A_log``, ``dt_bias``, ``f_a_proj``/``f_b_proj`` directly on ``self_attn``).

Recurrent state lives in a slot-indexed pool, one slot per running sequence
(``attn_metadata.state_slots``), two tensors per slot:

    conv state       [3*H*K, W-1]  model dtype: last W-1 raw inputs of the q|k|v
                                   channels, i.e. the conv's left context
    recurrent state  [H, K, V]     fp32

A sequence with ``context_lens == 0`` starts from zeros whatever its slot
holds (slots are reused); afterwards its slot holds the state after its last
new token.

On a GPU with the ``atom._C`` kernels, decode rows (one token each) and
speculative verification rows (1 + k tokens each, all the same length) run
``conv1d_update`` + ``kda_decode`` + ``gated_rmsnorm`` straight on the slot
pools (in a step of decode rows alone, or of verification rows of one length
alone, ``kda_decode`` applies the output norm itself);
prefill rows run ``conv1d_prefill`` and ``kda_prefill`` (chunked), both on
the packed tokens, straight on the pools. Elsewhere (CPU,
``ATOM_FORCE_REFERENCE=1``) every group runs the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from atom.forward_context import get_forward_context
from atom.layers.cache_spec import RecurrentStateSpec
from atom.layers.linear import Linear, StackedLinears
from atom.layers.norm import GatedRMSNorm
from atom.ops import PaddedLayout, split_decode_prefill
from atom.ops.cuda import conv1d_prefill, conv1d_update, gated_rmsnorm, kda_decode, kda_prefill, kernels_apply
from atom.ops.cuda.fused import kda_gate_proj
from atom.ops.kda import causal_conv1d_with_inputs, conv_states_per_token, kda, kda_recurrent_states, l2norm


class KimiDeltaAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_kernel_size: int,
        rms_norm_eps: float,
        layer_idx: int,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.layer_idx, self.dtype = num_heads, head_dim, layer_idx, dtype
        self.conv_kernel_size = conv_kernel_size
        dim = num_heads * head_dim

        def linear(n_in: int, n_out: int) -> Linear:
            return Linear(n_in, n_out, bias=False, dtype=dtype)

        self.q_proj, self.k_proj, self.v_proj = (linear(hidden_size, dim) for _ in range(3))
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (_DepthwiseConv(dim, conv_kernel_size, dtype) for _ in range(3))
        # decay gate: g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias), per channel
        self.f_a_proj, self.f_b_proj = linear(hidden_size, head_dim), linear(head_dim, dim)
        self.A_log = nn.Parameter(torch.empty(1, 1, num_heads, 1, dtype=dtype))
        self.dt_bias = nn.Parameter(torch.empty(dim, dtype=torch.float32))  # fp32 like transformers
        self.b_proj = linear(hidden_size, num_heads)
        self.g_a_proj, self.g_b_proj = linear(hidden_size, head_dim), linear(head_dim, dim)
        self.o_norm = GatedRMSNorm(head_dim, eps=rms_norm_eps, dtype=dtype)  # shared across heads
        self.o_proj = linear(dim, hidden_size)
        # [3*H*K, W] q|k|v conv weights in one tensor, made by fuse_conv_weights() after loading
        self.register_buffer("conv_weight", None, persistent=False)
        # every projection of x as one matmul (stacked by fuse_conv_weights()): q|k|v, then the gates' inputs
        self.in_proj = StackedLinears(self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.g_a_proj,
                                      self.b_proj)  # fmt: skip

    @torch.no_grad()
    def fuse_conv_weights(self) -> None:
        """Stack the loaded q/k/v conv weights and the input projections once; the
        checkpoint's parameters become views into the stacks."""
        self.in_proj.stack()
        fused = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)
        self.conv_weight = fused
        dim = self.num_heads * self.head_dim
        for i, conv in enumerate((self.q_conv1d, self.k_conv1d, self.v_conv1d)):
            conv.weight.data = fused[i * dim : (i + 1) * dim].unsqueeze(1)

    def _conv_weight(self) -> torch.Tensor:
        if self.conv_weight is not None:
            return self.conv_weight
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)

    def cache_spec(self) -> RecurrentStateSpec:
        dim, k = self.num_heads * self.head_dim, self.head_dim
        return RecurrentStateSpec(
            shapes=((3 * dim, self.conv_kernel_size - 1), (self.num_heads, k, k)),
            dtypes=(self.dtype, torch.float32),
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        md = get_forward_context().attn_metadata
        x = hidden_states
        dim = self.num_heads * self.head_dim
        # mixed [T, 3*H*K]: q|k|v before the conv, a column slice of the one matmul's rows
        mixed, f_a, g_a, b = self.in_proj(x).split([3 * dim, self.head_dim, self.head_dim, self.num_heads], dim=-1)
        # decay g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) [T, H, K] and beta = sigmoid(b(x)) [T, H], fp32;
        # the output gate g_b(g_a(x)) [T, H*K] (one kernel at decode sizes)
        g, beta, gate = kda_gate_proj(f_a, g_a, b, self.f_b_proj.weight, self.g_b_proj.weight, self.dt_bias,
                                      self.A_log, self.head_dim)
        # Fresh sequences start from zeros: select (not multiply) so stale NaNs cannot leak.
        continuing = md.has_initial_state
        fused = kernels_apply(x)
        apart = md.per_token_state_seqs
        gate = gate.unflatten(-1, (self.num_heads, self.head_dim))
        verifying = len(apart) == md.num_seqs and md.uniform_query_len > 0  # every row 1 + k tokens
        if fused and ((md.is_pure_decode and not apart) or verifying):
            # the whole step is one group of decode (or verification) rows: no split, no index tensors
            # (CUDA-graph capturable); the output norm runs in the decode kernel
            normed = self._recur_kernels(mixed, g, beta, (md.num_seqs, md.max_query_len), None,
                                         per_token=verifying, gate=gate)  # fmt: skip
            return self.o_proj(normed.flatten(1))
        out = self._recur_groups(mixed, g, beta, continuing, fused)
        if fused:
            return self.o_proj(gated_rmsnorm(out, gate, self.o_norm.weight, self.o_norm.eps).flatten(1))
        return self.o_proj(self.o_norm(out, gate).flatten(1))

    def _recur_groups(self, mixed, g, beta, continuing, fused: bool) -> torch.Tensor:
        """The step split into decode, prefill and verification groups; [T, H, V] in the model dtype."""
        md = get_forward_context().attn_metadata
        out = mixed.new_empty(mixed.shape[0], self.num_heads, self.head_dim)
        apart = md.per_token_state_seqs
        for layout in split_decode_prefill(md.query_start_loc, mixed.device, apart):
            per_token = bool(apart) and layout.seqs == apart
            whole = layout.num_seqs == md.num_seqs  # the group is the whole step, in order
            if fused and _kernel_group(md, layout, per_token):
                shape = (layout.num_seqs, layout.max_len)
                rows = self._recur_kernels(mixed, g, beta, shape, None if whole else layout, per_token)
            elif fused and not per_token:
                rows = self._prefill_kernel(mixed, g, beta, layout, whole)
            else:
                rows = self._recur(mixed, g, beta, continuing, layout, per_token).to(mixed.dtype)
            if whole:
                out = rows
            else:
                out[layout.token_ids] = rows
        return out

    def _recur_kernels(self, mixed, g, beta, shape: tuple[int, int], layout: PaddedLayout | None,
                       per_token: bool, gate: torch.Tensor | None = None) -> torch.Tensor:
        """``_recur`` for B sequences of T tokens each (decode: T = 1) through the CUDA kernels.

        The kernels read ``state_slots``, write ``state_out_slots`` (or, with
        ``per_token``, the state after token t to ``state_out_slots + t``) in place
        on the pools, and start fresh sequences from zeros. Returns [B*T, H, V]
        in the model dtype, through the output norm ``o_norm`` with ``gate`` [B*T, H, V]
        if given. ``shape`` is (B, T); ``layout`` None: the group is the step's whole
        batch, in order.
        """
        ctx = get_forward_context()
        conv_pool, state_pool = ctx.caches[self.layer_idx]
        md = ctx.attn_metadata
        tokens = (lambda t: t) if layout is None else (lambda t: t[layout.token_ids])  # noqa: E731
        seqs = (lambda t: t) if layout is None else (lambda t: t[layout.seq_ids])  # noqa: E731
        slots, out_slots, keep = seqs(md.state_slots), seqs(md.state_out_slots), seqs(md.has_initial_state)
        heads, dim = self.num_heads, self.head_dim
        conv = conv1d_update(tokens(mixed).view(*shape, -1), conv_pool, self._conv_weight(), slots,
                             out_slots=out_slots, per_token=per_token, has_initial_state=keep)  # fmt: skip
        q, k, v = (t.unflatten(-1, (heads, dim)) for t in conv.split(heads * dim, dim=-1))
        norm = None if gate is None else (tokens(gate).view(*shape, heads, dim), self.o_norm.weight, self.o_norm.eps)
        out = kda_decode(q, k, v, tokens(g).view(*shape, heads, dim), tokens(beta).view(*shape, heads), state_pool,
                         slots, out_slots=out_slots, per_token=per_token, has_initial_state=keep,
                         out_norm=norm)  # fmt: skip
        return out.view(-1, heads, dim)

    def _prefill_kernel(self, mixed, g, beta, layout: PaddedLayout, whole: bool) -> torch.Tensor:
        """``_recur`` for a group of prefill rows: ``conv1d_prefill``, then ``kda_prefill`` on the packed tokens.

        Returns [T', H, V] in the model dtype, in the order of ``layout.token_ids``.
        """
        ctx = get_forward_context()
        conv_pool, state_pool = ctx.caches[self.layer_idx]
        md = ctx.attn_metadata
        seqs = (lambda t: t) if whole else (lambda t: t[layout.seq_ids])  # noqa: E731
        slots, out_slots, keep = seqs(md.state_slots), seqs(md.state_out_slots), seqs(md.has_initial_state)
        tokens = (lambda t: t) if whole else (lambda t: t[layout.token_ids])  # noqa: E731
        packed = conv1d_prefill(tokens(mixed), layout.cu_seqlens, conv_pool, self._conv_weight(), slots,
                                out_slots=out_slots, has_initial_state=keep)  # [T', 3*H*K], sequence by sequence
        heads, dim = self.num_heads, self.head_dim
        q, k, v = (t.unflatten(-1, (heads, dim)) for t in packed.split(heads * dim, dim=-1))
        return kda_prefill(q, k, v, tokens(g), tokens(beta), layout.cu_seqlens, state_pool, slots,
                           out_slots=out_slots, has_initial_state=keep)  # fmt: skip

    def _recur(self, mixed, g, beta, continuing, layout: PaddedLayout, per_token: bool) -> torch.Tensor:
        """Short conv + delta rule for one group of sequences, through their state slots. Returns [T', H, V] fp32.

        Reads each sequence's state from ``state_slots``; writes the final state to
        ``state_out_slots`` or, with ``per_token``, the state after token j to
        ``state_out_slots + j`` (all reads happen before any write).
        """
        ctx = get_forward_context()
        conv_pool, state_pool = ctx.caches[self.layer_idx]
        md = ctx.attn_metadata
        slots, out_slots = md.state_slots[layout.seq_ids], md.state_out_slots[layout.seq_ids]
        keep = continuing[layout.seq_ids]
        conv_state = torch.where(keep[:, None, None], conv_pool[slots], 0)
        state = torch.where(keep[:, None, None, None], state_pool[slots], 0)

        weight = self._conv_weight()
        x = layout.pad(mixed).transpose(1, 2)
        conv_out, conv_state, window = causal_conv1d_with_inputs(x, conv_state, weight, layout.lengths)
        q, k, v = conv_out.transpose(1, 2).unflatten(-1, (3 * self.num_heads, self.head_dim)).float().chunk(3, dim=2)
        q = l2norm(q) * self.head_dim**-0.5
        # layout.pad fills padding with g = 0 and beta = 0: no decay, no update there.
        if not per_token:
            out, state = kda(q, l2norm(k), v, layout.pad(g), layout.pad(beta), state)
            conv_pool[out_slots] = conv_state
            state_pool[out_slots] = state
            return layout.unpad(out)
        out, states = kda_recurrent_states(q, l2norm(k), v, layout.pad(g), layout.pad(beta), state)
        # valid (row, j) pairs, in layout.index order: slot = out_slots[row] + j
        row, j = layout.index // layout.max_len, layout.index % layout.max_len
        targets = out_slots[row] + j
        conv_pool[targets] = conv_states_per_token(window, weight.shape[-1]).flatten(0, 1)[layout.index].to(
            conv_pool.dtype)
        state_pool[targets] = states.flatten(0, 1)[layout.index]
        return layout.unpad(out)


def _kernel_group(md, layout: PaddedLayout, per_token: bool) -> bool:
    """Whether the decode kernels take this group: decode rows, or verification rows all of one length."""
    if not per_token:
        return layout.max_len == 1
    lens = md.query_lens
    return all(lens[b] == layout.max_len for b in layout.seqs)


class _DepthwiseConv(nn.Module):
    """Holds a depthwise conv1d weight [C, 1, W] under the checkpoint's ``*_conv1d.weight`` name."""

    def __init__(self, channels: int, kernel_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, dtype=dtype))
