"""Small fused ops of the decode step (``csrc/fused.cu``), each with its torch reference.

At decode batch sizes a step is hundreds of tiny kernels, and inside a CUDA
graph each still costs its launch slot (~2 us on an H200), so a chain of
eight elementwise ops costs more than the matmul it feeds. Each op here is
one kernel on a GPU with ``atom._C`` and its ``*_ref`` elsewhere. The
references are the model's own torch code (the layers call these functions),
so both paths round to the model dtype at the same points.

    rms_norm      weight * round(x * rsqrt(mean(x^2) + eps))
    silu_mul      round(silu(gate)) * up over [gate | up] rows
    kda_gate      KDA's log-decay g and beta from their projections
    kda_gate_proj kda_gate with its two low-rank up-projections (the decay's and the output gate's)
    moe_route     sigmoid router: top-k on score + bias, renormalised, scaled
    moe_align     (token, pick) pairs grouped by expert, for grouped matmuls
    moe_combine   each token's weighted sum over its picks (+ an addend)
    moe_gemv      routed experts at decode batch sizes: the picked experts' rows times each token
                  (``csrc/moe_gemv.cu``; two kernels for the grouped path's eight)
    advance_decode  multi-step decoding: the CUDA-graph decode buffers one step on
    pack_verification, settle_verification  speculation with overlap: a verification step's outcome in one
                  tensor, and the next step's rows planned meanwhile made right from it
    accept_drafts each verified row's accepted drafts, next token and targets from its drafts' checks
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from atom.ops.cuda._launch import C, dtype_code, kernels_apply, stream_of
from atom.ops.cuda.linear import linear


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, dim] with a contiguous last dim (a view when possible)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# -- rms_norm -----------------------------------------------------------------------


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 x * rsqrt(mean(x^2) + eps) over the last dim (every RMS norm's reference)."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * rms_normalize(x, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * normalize(x).to(x.dtype)`` over the last dim, normalising in fp32 (x's shape and dtype)."""
    if not kernels_apply(x, weight) or weight.dtype != x.dtype:
        return rms_norm_ref(x, weight, eps)
    return _rms_norm_kernel(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(rms_norm(s), s)`` for ``s = x + residual``: a residual add and the norm after it, one kernel on a GPU."""
    if (not kernels_apply(x, residual, weight) or not x.dtype == residual.dtype == weight.dtype
            or residual.shape != x.shape):  # fmt: skip
        s = x + residual
        return rms_norm_ref(s, weight, eps), s
    return _rms_norm_kernel(x, residual, weight, eps)


def _rms_norm_kernel(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    r2 = s2 = None
    if residual is not None:
        r2 = _rows(residual)
        s2 = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    C().rms_norm(x2.data_ptr(), x2.stride(0), 0 if r2 is None else r2.data_ptr(), 0 if r2 is None else r2.stride(0),
                 0 if s2 is None else s2.data_ptr(), 0 if s2 is None else s2.stride(0), weight.data_ptr(),
                 out.data_ptr(), out.stride(0), x2.shape[0], x2.shape[1], float(eps), dtype_code(x.dtype),
                 stream_of(x.device))  # fmt: skip
    return out.view(x.shape), None if s2 is None else s2.view(x.shape)


# -- silu_mul -----------------------------------------------------------------------


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = gate | up -> silu(gate) * up [..., I], each op rounding to x's dtype."""
    if not kernels_apply(x):
        return silu_mul_ref(x)
    x2 = _rows(x)
    width = x2.shape[1] // 2
    out = torch.empty(x2.shape[0], width, dtype=x.dtype, device=x.device)
    C().silu_mul(x2.data_ptr(), x2.stride(0), out.data_ptr(), out.stride(0), x2.shape[0], width,
                 dtype_code(x.dtype), stream_of(x.device))  # fmt: skip
    return out.view(*x.shape[:-1], width)


# -- kda_gate -----------------------------------------------------------------------


def kda_gate_ref(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    raw = (f.float() + dt_bias.float()).unflatten(-1, (-1, head_dim))
    # softplus written out as transformers does (identity above 20), to round the same way
    softplus = torch.where(raw > 20.0, raw, torch.log(1.0 + torch.exp(raw)))
    g = -torch.exp(a_log.float().view(-1, 1)) * softplus
    return g, torch.sigmoid(b).float()


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
             head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """KDA's per-channel log-decay and update strength.

    f [T, H*K] (the decay projection, model dtype), dt_bias fp32 [H*K], a_log
    [H] (any shape with H elements), b [T, H] (the beta projection). Returns
    (g fp32 [T, H, K] = -exp(a_log) * softplus(f + dt_bias), beta fp32 [T, H]
    = sigmoid(b) rounded to the model dtype first).
    """
    tokens, heads = b.shape
    if not kernels_apply(f, b) or dt_bias.dtype != torch.float32 or a_log.dtype != f.dtype or b.dtype != f.dtype:
        return kda_gate_ref(f, dt_bias, a_log, b, head_dim)
    f2, b2 = _rows(f), _rows(b)
    g = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=f.device)
    beta = torch.empty(tokens, heads, dtype=torch.float32, device=f.device)
    C().kda_gate(f2.data_ptr(), f2.stride(0), dt_bias.contiguous().data_ptr(), a_log.contiguous().data_ptr(),
                 b2.data_ptr(), b2.stride(0), g.data_ptr(), beta.data_ptr(), tokens, heads, head_dim,
                 dtype_code(f.dtype), stream_of(f.device))  # fmt: skip
    return g, beta


# -- kda_gate_proj ------------------------------------------------------------------

# Up to this many tokens kda_gate_proj runs its one kernel; above, two linears and kda_gate. Kimi-Linear's
# shape (32 heads of 128, rank 128, bf16), back to back in a CUDA graph: 2.7 against 6.9 us at 1 token, 4.2
# against 9.3 at 8, 5.5 against 9.3 at 16, even at 32, 15.8 against 9.6 at 64 (GPU_NOTES.md, session 25).
# ATOM_KDA_GATE_PROJ_MAX_TOKENS overrides (read at import; 0 turns the kernel off).
KDA_GATE_PROJ_MAX_TOKENS = int(os.environ.get("ATOM_KDA_GATE_PROJ_MAX_TOKENS", 16))


def kda_gate_proj_ref(f_a: torch.Tensor, g_a: torch.Tensor, b: torch.Tensor, w_f: torch.Tensor,
                      w_g: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                      head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    g, beta = kda_gate_ref(F.linear(f_a, w_f), dt_bias, a_log, b, head_dim)
    return g, beta, F.linear(g_a, w_g)


def kda_gate_proj(f_a: torch.Tensor, g_a: torch.Tensor, b: torch.Tensor, w_f: torch.Tensor, w_g: torch.Tensor,
                  dt_bias: torch.Tensor, a_log: torch.Tensor,
                  head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """KDA's gates from its low-rank inputs: ``kda_gate(f_a w_f^T, ...)`` and the output gate ``g_a w_g^T``.

    f_a, g_a [T, R] and b [T, H] (model dtype; views into one projection's
    output are read in place), w_f and w_g [H*K, R]. Returns (g fp32 [T, H, K],
    beta fp32 [T, H], gate [T, H*K] in the model dtype). At decode sizes (up to
    KDA_GATE_PROJ_MAX_TOKENS tokens) one kernel, where it is two linears and
    kda_gate: three launches for 2 MB of weights.
    """
    tokens, heads = b.shape
    channels, dim = w_f.shape
    if (tokens > KDA_GATE_PROJ_MAX_TOKENS or not kernels_apply(f_a, g_a, b, w_f, w_g)
            or not all(t.dtype == f_a.dtype for t in (g_a, b, w_f, w_g, a_log)) or dt_bias.dtype != torch.float32
            or f_a.shape != (tokens, dim) or g_a.shape != f_a.shape or w_g.shape != w_f.shape
            or channels != heads * head_dim or dt_bias.numel() != channels or a_log.numel() != heads
            or not (w_f.is_contiguous() and w_g.is_contiguous())
            or f_a.stride() != g_a.stride() or f_a.stride(-1) != 1 or b.stride(-1) != 1):  # fmt: skip
        g, beta = kda_gate(linear(f_a, w_f), dt_bias, a_log, b, head_dim)
        return g, beta, linear(g_a, w_g)
    g = torch.empty(tokens, heads, head_dim, dtype=torch.float32, device=f_a.device)
    beta = torch.empty(tokens, heads, dtype=torch.float32, device=f_a.device)
    gate = torch.empty(tokens, channels, dtype=f_a.dtype, device=f_a.device)
    C().kda_gate_proj(f_a.data_ptr(), g_a.data_ptr(), f_a.stride(0) if tokens > 1 else dim, b.data_ptr(),
                      b.stride(0) if tokens > 1 else heads, tokens, w_f.data_ptr(), w_g.data_ptr(), channels, dim,
                      dt_bias.contiguous().data_ptr(), a_log.contiguous().data_ptr(), heads, g.data_ptr(),
                      beta.data_ptr(), gate.data_ptr(), dtype_code(f_a.dtype), stream_of(f_a.device))  # fmt: skip
    return g, beta, gate


# -- moe_route ----------------------------------------------------------------------


def moe_route_ref(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    scores = logits.float().sigmoid()
    biased = scores if bias is None else scores + bias
    ids = biased.topk(top_k, dim=-1).indices  # best first
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


# Up to this many tokens a kernel (csrc/fused.cu picks the per-token or the spread one by shape); above, the fp32
# matmul (the crossover is not measured).
ROUTER_KERNEL_MAX_TOKENS = 256


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits [T, E] = x [T, D] (any float dtype) times weight fp32 [E, D]^T, summed in fp32.

    One kernel at decode sizes (up to ROUTER_KERNEL_MAX_TOKENS rows), where the
    reference is a copy of x to fp32 and a fp32 matmul.
    """
    tokens, dim = x.shape
    if (not kernels_apply(x, weight) or weight.dtype != torch.float32 or tokens > ROUTER_KERNEL_MAX_TOKENS
            or not weight.is_contiguous()):  # fmt: skip
        return router_logits_ref(x, weight)
    x2 = _rows(x)
    logits = torch.empty(tokens, weight.shape[0], dtype=torch.float32, device=x.device)
    C().router_logits(x2.data_ptr(), x2.stride(0), weight.data_ptr(), logits.data_ptr(), tokens, weight.shape[0],
                      dim, dtype_code(x.dtype), stream_of(x.device))  # fmt: skip
    return logits


def moe_route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sigmoid router without group limits: (weights fp32 [T, k], expert ids int64 [T, k]), best pick first.

    logits fp32 [T, E]; experts are chosen on sigmoid(logits) + bias, weighted
    by sigmoid(logits) (renormalised over the picks if asked), times scale.
    """
    tokens, experts = logits.shape
    if not kernels_apply(logits) or logits.dtype != torch.float32 or experts > 256 or top_k > 32:
        return moe_route_ref(logits, bias, top_k, renormalize, scale)
    logits2 = _rows(logits)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    bias_ptr = 0 if bias is None else bias.float().contiguous().data_ptr()
    C().moe_route(logits2.data_ptr(), logits2.stride(0), bias_ptr, tokens, experts, top_k, renormalize, float(scale),
                  ids.data_ptr(), weights.data_ptr(), stream_of(logits.device))  # fmt: skip
    return weights, ids


# -- moe_align / moe_combine --------------------------------------------------------


def moe_align_ref(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # grouped row -> pair
    pos = torch.empty_like(order).scatter_(0, order, torch.arange(len(order), device=ids.device))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order // ids.shape[1], pos, counts.cumsum(0, dtype=torch.int32)


def moe_align(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the (token, pick) pairs of ids [T, k] by expert, keeping pair order within an expert.

    Returns (src_token int64 [T*k]: the token of each grouped row, pos int64
    [T*k]: each pair's grouped row, ends int32 [E]: cumulative rows per
    expert, the ``offs`` of ``torch._grouped_mm``).
    """
    if not kernels_apply(ids) or ids.dtype != torch.int64 or num_experts > 1024:
        return moe_align_ref(ids, num_experts)
    flat = ids.contiguous().view(-1)
    src_token, pos = torch.empty_like(flat), torch.empty_like(flat)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    scratch = C().moe_align_workspace_ints(flat.numel(), num_experts)  # many pairs: a tiled form, two launches
    workspace = torch.empty(scratch, dtype=torch.int32, device=ids.device) if scratch else None
    C().moe_align(flat.data_ptr(), flat.numel(), num_experts, ids.shape[1], src_token.data_ptr(), pos.data_ptr(),
                  ends.data_ptr(), 0 if workspace is None else workspace.data_ptr(), stream_of(ids.device))  # fmt: skip
    return src_token, pos, ends


def _pick_rows(pos: torch.Tensor, tokens: int, expert_major: bool) -> torch.Tensor:
    """Each pick's row of y: pos itself, or (expert_major: pos holds expert ids) ids * T + t."""
    if not expert_major:
        return pos
    return (pos.view(tokens, -1) * tokens + torch.arange(tokens, device=pos.device).unsqueeze(1)).flatten()


def moe_combine_ref(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                    addend: torch.Tensor | None = None, expert_major: bool = False) -> torch.Tensor:  # fmt: skip
    tokens, top_k = weights.shape
    picks = y[_pick_rows(pos, tokens, expert_major)].view(tokens, top_k, -1).float()
    out = (picks * weights.unsqueeze(-1)).sum(dim=1).to(y.dtype)
    return out if addend is None else out + addend


def moe_combine(y: torch.Tensor, pos: torch.Tensor, weights: torch.Tensor,
                addend: torch.Tensor | None = None, expert_major: bool = False) -> torch.Tensor:  # fmt: skip
    """Each token's picks summed: weights fp32 [T, k]; y [T*k, D] grouped rows with pos [T*k] each
    pick's row (moe_align), or, ``expert_major``, y [E*T, D] every expert's output on every token
    (row e * T + t) with pos [T, k] the picked expert ids.

    Sums in fp32 in pick order and rounds once to y's dtype; then adds
    ``addend`` [T, D] (e.g. the shared experts' output) as a separate add.
    """
    tokens, top_k = weights.shape
    if not kernels_apply(y, pos, weights) or weights.dtype != torch.float32 or (
        addend is not None and addend.dtype != y.dtype
    ):
        return moe_combine_ref(y, pos, weights, addend, expert_major)
    y = y.contiguous()
    out = torch.empty(tokens, y.shape[1], dtype=y.dtype, device=y.device)
    add_ptr = 0 if addend is None else addend.contiguous().data_ptr()
    C().moe_combine(y.data_ptr(), pos.contiguous().data_ptr(), weights.contiguous().data_ptr(), add_ptr,
                    out.data_ptr(), tokens, top_k, y.shape[1], tokens if expert_major else 0, dtype_code(y.dtype),
                    stream_of(y.device))  # fmt: skip
    return out


# -- moe_gemv -----------------------------------------------------------------------


def moe_gemv_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, addend: torch.Tensor | None = None,
                 shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    tokens, top_k = ids.shape
    picked = ids.flatten()  # pair p = t * top_k + j
    xs = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [P, D, 1]
    act = silu_mul_ref(torch.bmm(gate_up[picked], xs).squeeze(-1))  # [P, I]
    y = torch.bmm(down[picked], act.unsqueeze(-1)).squeeze(-1)  # [P, D]
    if shared is not None:  # the shared expert as its own gated MLP (GatedMLP.forward)
        addend = F.linear(silu_mul_ref(F.linear(x, shared[0])), shared[1])
    return moe_combine_ref(y, torch.arange(tokens * top_k, device=x.device), weights, addend)


def moe_gemv(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, addend: torch.Tensor | None = None,
             shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
    """Routed experts for a few tokens: x [T, D]; weights fp32 and ids int64 [T, k]; the stacked
    gate_up [E, 2I, D] (gate rows, then up rows) and down [E, D, I]; plus ``addend`` [T, D], or
    plus the output of a shared expert given as its weights ``shared`` = (gate_up [2S, D], down [D, S]).

    What the grouped path (and the shared expert's own MLP) computes, rounding where
    they round (gate_up, silu_mul and down outputs in x's dtype; each token's picks
    summed in fp32 in pick order, rounded once, then the addend added): two kernels
    that read each pair's expert rows once. The reference gathers the picked experts'
    weights (no host sync).
    """
    if addend is not None and shared is not None:
        raise ValueError("moe_gemv: pass an addend or a shared expert, not both")
    tokens, top_k = ids.shape
    experts, dim, inter = down.shape
    if gate_up.shape != (experts, 2 * inter, dim) or x.shape != (tokens, dim) or weights.shape != ids.shape or (
        shared is not None and (shared[1].shape[0] != dim or shared[0].shape != (2 * shared[1].shape[1], dim))
    ):
        raise ValueError("moe_gemv: the shapes of x, weights, ids and the expert weights do not fit together")
    stacks = [gate_up, down, *(shared or ())]
    rows_ok = all(w.stride(-1) == 1 and w.stride(-2) == w.shape[-1] for w in stacks)  # contiguous rows
    if (not kernels_apply(x, weights, ids, *stacks, addend) or not rows_ok
            or ids.dtype != torch.int64 or weights.dtype != torch.float32
            or any(w.dtype != x.dtype for w in stacks) or (addend is not None and addend.dtype != x.dtype)):  # fmt: skip
        return moe_gemv_ref(x, weights, ids, gate_up, down, addend, shared)
    x2, ids, weights = _rows(x), ids.contiguous(), weights.contiguous()
    pairs, s_inter = tokens * top_k, 0 if shared is None else shared[1].shape[1]
    act = torch.empty(pairs * inter + tokens * s_inter, dtype=x.dtype, device=x.device)
    out = torch.empty(tokens, dim, dtype=x.dtype, device=x.device)
    code, stream = dtype_code(x.dtype), stream_of(x.device)
    s_up, s_down = (0, 0) if shared is None else (shared[0].data_ptr(), shared[1].data_ptr())
    C().moe_gemv_up(x2.data_ptr(), x2.stride(0), ids.data_ptr(), tokens, top_k, gate_up.data_ptr(),
                    gate_up.stride(0), inter, s_up, s_inter, act.data_ptr(), dim, code, stream)  # fmt: skip
    s_act = 0 if shared is None else act[pairs * inter :].data_ptr()
    add_ptr = 0 if addend is None else addend.contiguous().data_ptr()
    C().moe_gemv_down(act.data_ptr(), ids.data_ptr(), weights.data_ptr(), tokens, top_k, down.data_ptr(),
                      down.stride(0), inter, s_act, s_down, s_inter, add_ptr, out.data_ptr(), dim, code,
                      stream)  # fmt: skip
    return out


# -- advance_decode -----------------------------------------------------------------
# The rows of the CUDA graphs' static int64 decode buffer (atom/worker/cuda_graph.py), in the
# order csrc/fused.cu's DecodeRow enum names them.
INPUT_IDS, POSITIONS, SLOT_MAPPING, STATE_SLOTS, STATE_OUT_SLOTS, HAS_INITIAL_STATE, SEQ_LENS = range(7)


def advance_decode_ref(rows: torch.Tensor, tables: torch.Tensor, next_ids: torch.Tensor, block_size: int) -> None:
    n = next_ids.shape[0]
    cols = rows[:, :n]
    cols[INPUT_IDS] = next_ids
    cols[POSITIONS] += 1
    cols[SEQ_LENS] += 1
    cols[HAS_INITIAL_STATE] = 1
    cols[STATE_SLOTS] = cols[STATE_OUT_SLOTS]
    pos = cols[POSITIONS]
    block = tables[:n].gather(1, (pos // block_size).unsqueeze(1)).squeeze(1)
    cols[SLOT_MAPPING] = block * block_size + pos % block_size


def advance_decode(rows: torch.Tensor, tables: torch.Tensor, next_ids: torch.Tensor, block_size: int) -> None:
    """Moves columns [:n] (n = len(next_ids)) of the decode buffers ``rows`` [7, S] one decode step on,
    in place: input next_ids, position and length + 1, the state read from where the last step wrote
    it, the cache slot of the new position from the block tables [>= n, W]. One kernel on a GPU
    (the reference is 11 small ones)."""
    if (not kernels_apply(rows, tables, next_ids) or rows.stride(1) != 1 or tables.stride(1) != 1
            or not next_ids.is_contiguous()
            or not rows.dtype == tables.dtype == next_ids.dtype == torch.int64):  # fmt: skip
        return advance_decode_ref(rows, tables, next_ids, block_size)
    C().advance_decode(rows.data_ptr(), rows.stride(0), tables.data_ptr(), tables.stride(0), next_ids.data_ptr(),
                       next_ids.shape[0], block_size, stream_of(rows.device))  # fmt: skip


# -- speculation with overlap: a verification's outcome, and the rows planned while it ran ------------------------


def leading_matches(inputs: torch.Tensor, targets: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """Per row of verification columns ``[t, d1 .. dk]`` ([n, 1 + k] ``inputs``): how many of its own
    ``num_drafts`` drafts lead in a run equal to the ``targets`` of the columns before them (a greedy row's
    argmax, a sampled row's ``Verdict.targets``): its accepted drafts. [n] int64."""
    own = torch.arange(inputs.shape[1] - 1, device=inputs.device) < num_drafts.unsqueeze(1)
    return ((inputs[:, 1:] == targets[:, :-1]) & own).long().cumprod(dim=1).sum(dim=1)


def pack_verification_ref(rows: torch.Tensor, targets: torch.Tensor, drafts: torch.Tensor, width: int) -> torch.Tensor:
    """targets [n, width] | accepted [n] | drafts [k, n] in one int64 tensor. ``rows``: the step's decode buffers
    [7, S] (row r's tokens in columns r * width ..); ``targets`` [n * width]; ``drafts`` [k, n] (any strides). A
    row's accepted count: the leading run of its own drafts (its columns past the first with seq_len > 0) equal to
    the targets of the columns before them."""
    n = targets.numel() // width
    inputs, lens = rows[INPUT_IDS, : n * width].view(n, width), rows[SEQ_LENS, : n * width].view(n, width)
    accepted = leading_matches(inputs, targets.view(n, width), (lens > 0).sum(dim=1) - 1)
    return torch.cat((targets.flatten(), accepted, drafts.flatten()))


def pack_verification(rows: torch.Tensor, targets: torch.Tensor, drafts: torch.Tensor, width: int) -> torch.Tensor:
    """One kernel on a GPU (the reference is ~8 small ones)."""
    n = targets.numel() // width
    if (not kernels_apply(rows, targets, drafts) or rows.stride(1) != 1 or not targets.is_contiguous()
            or drafts.stride(1) != 1 or not rows.dtype == targets.dtype == drafts.dtype == torch.int64):  # fmt: skip
        return pack_verification_ref(rows, targets, drafts, width)
    out = torch.empty(n * (width + 1) + drafts.numel(), dtype=torch.long, device=rows.device)
    C().pack_verification(rows.data_ptr(), rows.stride(0), targets.data_ptr(), drafts.data_ptr(), drafts.stride(0), n,
                          width, drafts.shape[0], out.data_ptr(), stream_of(rows.device))  # fmt: skip
    return out


def settle_verification_ref(rows: torch.Tensor, tables: torch.Tensor, index: torch.Tensor, packed: torch.Tensor,
                            n_prev: int, width: int, block_size: int) -> None:  # fmt: skip
    """Rows planned while the step before ran (``packed`` by ``pack_verification``, n_prev rows), written into the
    decode buffers ``rows`` as if it had accepted every draft, made right in place. ``index`` [3m]: this step's
    row, its row in the step before, the drafts planned for it there. Row i's token j: input the token emitted
    last (j = 0) or the (j-1)-th next draft, position, seq_len and cache slot moved back by the drafts rejected
    (planned - accepted), and so its state slot (where it has one)."""
    m, w = index.numel() // 3, width
    here, there, planned = index[:m], index[m : 2 * m], index[2 * m :]
    targets = packed[: n_prev * w].view(n_prev, w)
    accepted = packed[n_prev * w : n_prev * (w + 1)][there]
    drafts = packed[n_prev * (w + 1) :].view(-1, n_prev)
    back = planned - accepted
    last = targets[there].gather(1, accepted.unsqueeze(1))  # [m, 1]
    columns = (here.unsqueeze(1) * w + torch.arange(w, device=rows.device)).flatten()
    rows[INPUT_IDS, columns] = torch.cat((last, drafts[:, there].T), dim=1).flatten()
    positions = rows[POSITIONS, columns] - back.repeat_interleave(w)
    rows[POSITIONS, columns] = positions
    rows[SEQ_LENS, columns] = positions + 1
    blocks = tables[here].gather(1, (positions // block_size).view(m, w)).flatten()
    rows[SLOT_MAPPING, columns] = blocks * block_size + positions % block_size
    state = rows[STATE_SLOTS, here]
    rows[STATE_SLOTS, here] = torch.where(state >= 0, state - back, state)


def settle_verification(rows: torch.Tensor, tables: torch.Tensor, index: torch.Tensor, packed: torch.Tensor,
                        n_prev: int, width: int, block_size: int) -> None:  # fmt: skip
    """One kernel on a GPU (the reference is ~15 small ones)."""
    if (not kernels_apply(rows, tables, index, packed) or rows.stride(1) != 1 or tables.stride(1) != 1
            or not index.is_contiguous() or not packed.is_contiguous()
            or not rows.dtype == tables.dtype == index.dtype == packed.dtype == torch.int64):  # fmt: skip
        return settle_verification_ref(rows, tables, index, packed, n_prev, width, block_size)
    C().settle_verification(rows.data_ptr(), rows.stride(0), tables.data_ptr(), tables.stride(0), index.data_ptr(),
                            index.numel() // 3, packed.data_ptr(), n_prev, width, block_size,
                            stream_of(rows.device))  # fmt: skip


def accept_drafts_ref(tokens: torch.Tensor, at: torch.Tensor, proposed: torch.Tensor, num_drafts: torch.Tensor,
                      probs: torch.Tensor | None = None,
                      draws: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The acceptance of n verified rows of at most k drafts: row r's draft j (``proposed`` [n, k], j <
    ``num_drafts[r]``) checks logits row ``at[r, j]`` (``at`` [n, k + 1]); it holds where that row's token
    (``tokens`` [rows]) is the draft (greedy: ``probs`` None), else where u < p(draft) for u = exp(-E), E the row's
    last Exp(1) draw (``draws`` [rows]) and p ``probs`` [rows]. int64 accepted [n] | final [n] (the token of row
    ``at[r, accepted]``) | targets [n, k + 1] (the accepted drafts, then final repeated) in one tensor."""
    n, k = proposed.shape
    checks = at[:, :k]
    holds = proposed == tokens[checks] if probs is None else (torch.exp(-draws) < probs)[checks]
    own = torch.arange(k, device=at.device) < num_drafts.unsqueeze(1)
    accepted = (holds & own).long().cumprod(dim=1).sum(dim=1)
    final = tokens[at.gather(1, accepted.unsqueeze(1)).squeeze(1)]
    column = torch.arange(k + 1, device=at.device)
    targets = torch.where(column < accepted.unsqueeze(1), F.pad(proposed, (0, 1)), final.unsqueeze(1))
    return torch.cat((accepted, final, targets.flatten()))


def accept_drafts(tokens: torch.Tensor, at: torch.Tensor, proposed: torch.Tensor, num_drafts: torch.Tensor,
                  probs: torch.Tensor | None = None, draws: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """One kernel on a GPU (the reference is ~15 small ones). ``draws`` may be a column of a wider tensor."""
    n, k = proposed.shape
    sampled = probs is not None
    if (not kernels_apply(tokens, at, proposed, num_drafts, probs, draws)
            or not tokens.is_contiguous() or not at.is_contiguous() or not num_drafts.is_contiguous()
            or (k > 0 and proposed.stride(1) != 1)
            or not tokens.dtype == at.dtype == proposed.dtype == num_drafts.dtype == torch.int64
            or (sampled and (not probs.is_contiguous()
                             or not probs.dtype == draws.dtype == torch.float32))):  # fmt: skip
        return accept_drafts_ref(tokens, at, proposed, num_drafts, probs, draws)
    out = torch.empty(n * (k + 3), dtype=torch.long, device=tokens.device)
    C().accept_drafts(tokens.data_ptr(), probs.data_ptr() if sampled else 0, draws.data_ptr() if sampled else 0,
                      draws.stride(0) if sampled else 0, at.data_ptr(), proposed.data_ptr(),
                      proposed.stride(0) if k > 0 else 0, num_drafts.data_ptr(), n, k, out.data_ptr(),
                      stream_of(tokens.device))  # fmt: skip
    return out
