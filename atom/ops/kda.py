"""Torch references for Kimi Delta Attention (KDA): short conv and gated delta rule.

All functions take right-padded batches ``[B, L, ...]`` (see ``atom.ops``).
Padded positions must carry ``g = 0`` and ``beta = 0``: then the decay is 1 and
the update is 0, so they leave the recurrent state untouched.

Per head, with fp32 state ``S [K, V]``, each token does::

    S = exp(g)[:, None] * S          # per-channel decay, g <= 0
    u = beta * (v - S^T k)           # delta rule correction
    S = S + k u^T
    o = S^T q                        # uses the updated state
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Prefills at least this long use the chunked (WY) form; shorter ones the loop.
CHUNKED_MIN_LEN = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's form: eps inside the sqrt)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU continuing from a per-sequence state.

    x: [B, C, L] new raw inputs (right-padded); conv_state: [B, C, W-1] the last
    W-1 raw inputs before them (zeros for a fresh sequence); weight: [C, W];
    lengths: [B] valid inputs per row. Returns (silu(conv) [B, C, L], new state
    [B, C, W-1] = the last W-1 valid raw inputs, reaching into the old state when
    fewer than W-1 are new). Computes in the weight's dtype, like transformers.
    """
    out, new_state, _ = causal_conv1d_with_inputs(x, conv_state, weight, lengths)
    return out, new_state


def causal_conv1d_with_inputs(x, conv_state, weight, lengths):
    """``causal_conv1d`` that also returns its input window [B, C, W-1+L] (old state + new inputs)."""
    width = weight.shape[-1]
    full = torch.cat([conv_state.to(x.dtype), x], dim=-1).to(weight.dtype)  # [B, C, W-1+L]
    out = F.silu(F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0]))  # [B, C, L]
    # The last valid input of row b sits at full index (W-2) + lengths[b].
    keep = lengths[:, None] + torch.arange(width - 1, device=x.device)[None, :]  # [B, W-1]
    new_state = full.gather(2, keep[:, None, :].expand(-1, full.shape[1], -1))
    return out.to(x.dtype), new_state.to(conv_state.dtype), full


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule (the reference).

    q, k: [B, L, H, K] fp32, already l2-normalised (q also scaled by K^-0.5);
    v: [B, L, H, V]; g: [B, L, H, K] log-decay (<= 0); beta: [B, L, H];
    state: [B, H, K, V] fp32. Returns (o [B, L, H, V] fp32, final state).
    """
    out = torch.empty(*v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[1]):
        state = state * g[:, t].exp().unsqueeze(-1)
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        update = (v[:, t] - predicted) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * update.unsqueeze(-2)
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


def kda_recurrent_states(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``kda_recurrent`` that also returns the state after every token: [B, L, H, K, V].

    For speculative verification (L = 1 + drafts, small): the next step resumes
    from the state after the last accepted token.
    """
    states = torch.empty(*q.shape[:2], *state.shape[1:], dtype=torch.float32, device=q.device)
    outs = []
    for t in range(q.shape[1]):
        o, state = kda_recurrent(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], g[:, t : t + 1],
                                 beta[:, t : t + 1], state)
        outs.append(o)
        states[:, t] = state
    return torch.cat(outs, dim=1), states


def conv_states_per_token(full: torch.Tensor, width: int) -> torch.Tensor:
    """From [B, C, W-1+L] (old state then new raw inputs): the conv state after each token, [B, L, C, W-1]."""
    return full.unfold(2, width - 1, 1)[:, :, 1:].permute(0, 2, 1, 3)


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 16,  # small chunks: the [C, C, K] decay tensor dominates on CPU
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and result as ``kda_recurrent``, in chunks (WY form).

    Within a chunk, with G_t = cumsum(g)_t (inclusive) and S0 the state at the
    chunk start, the corrections U = [u_t] solve a unit lower-triangular system

        (I + A) U = beta*V - beta*(k*exp(G)) S0,
        A[t, j] = beta_t * sum_c k_tc k_jc exp(G_tc - G_jc)        (j < t)

    and then  o_t = (q_t*exp(G_t)) S0 + sum_{j<=t} (q_t . k_j exp(G_t - G_j)) u_j,
    S_end = exp(G_last) * S0 + sum_j (k_j * exp(G_last - G_j)) u_j^T.
    """
    batch, length = q.shape[:2]
    pad = (-length) % chunk_size
    if pad:  # zero g/beta padding leaves the state alone, as in the varlen batch
        q, k, v, g, beta = (F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad)) for x in (q, k, v, g, beta))
    # [B, L, H, D] -> [B, H, N, C, D]: chunks of C tokens per head
    q, k, v, g = (x.unflatten(1, (-1, chunk_size)).permute(0, 3, 1, 2, 4) for x in (q, k, v, g))
    beta = beta.unflatten(1, (-1, chunk_size)).permute(0, 3, 1, 2)
    out = torch.empty_like(v)
    for n in range(q.shape[2]):
        out[:, :, n], state = _kda_chunk(q[:, :, n], k[:, :, n], v[:, :, n], g[:, :, n], beta[:, :, n], state)
    out = out.flatten(2, 3)[:, :, :length].transpose(1, 2)  # [B, L, H, V]
    return out, state


def _kda_chunk(q, k, v, g, beta, state):
    """One chunk: q, k, g [B, H, C, K]; v [B, H, C, V]; beta [B, H, C]; state [B, H, K, V]."""
    size = q.shape[2]
    cum = g.cumsum(dim=2)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_j) per channel, only for j <= t (the rest would overflow and is unused)
    diff = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(~causal[..., None], float("-inf"))
    decay = diff.exp()  # [B, H, C(t), C(j), K]
    k_beta = k * beta.unsqueeze(-1)
    a = torch.einsum("bhtc,bhjc,bhtjc->bhtj", k_beta, k, decay).tril(-1)  # strictly lower
    eye = torch.eye(size, dtype=q.dtype, device=q.device)
    rhs = torch.cat([v * beta.unsqueeze(-1), k_beta * cum.exp()], dim=-1)
    solved = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    v_beta_solved, kdecay_solved = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    u = v_beta_solved - kdecay_solved @ state  # [B, H, C, V]
    scores = torch.einsum("bhtc,bhjc,bhtjc->bhtj", q, k, decay)  # zero above the diagonal
    out = (q * cum.exp()) @ state + scores @ u
    last = cum[:, :, -1:]  # [B, H, 1, K]
    state = state * last.transpose(-1, -2).exp() + (k * (last - cum).exp()).transpose(-1, -2) @ u
    return out, state


def kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: chunked form for long prefills, the per-token loop otherwise."""
    if q.shape[1] >= CHUNKED_MIN_LEN:
        return kda_chunked(q, k, v, g, beta, state)
    return kda_recurrent(q, k, v, g, beta, state)
