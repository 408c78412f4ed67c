"""GQA decode attention of dense models (Llama, Qwen3) over paged K and V caches, and their cache writes.

Caches [num_blocks, block_size, kv_heads, head_dim], as ``atom.ops.paged_attention`` lays them out.
``paged_decode_attention`` takes one query row per token over its own prefix (for 1 + k speculative
tokens: a row per token, its own seq_len and its sequence's block-table row repeated).
``write_kv_cache`` stores a step's keys and values at ``slot_mapping`` with ``write_latent_cache``'s
kernel: a token's row of a K or V cache (kv_heads * head_dim values) is a latent row with no rope part.
``rotary_write_kv`` rotates q and k (neox rotary) and writes k and v in one kernel, for every step on a GPU.
``paged_prefill_attention`` attends a step's prefill chunks (causal, each after its cached context) in one launch
on tensor cores, where it applies (bf16/fp16, head_dim 64 or 128, NVIDIA); SDPA's kernels a sequence at a time
elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from atom.forward_context import upload
from atom.ops.cuda._launch import C, device_guard, dtype_code, kernels_apply, num_sms, stream_of, wave_splits
from atom.ops.cuda.mla import write_latent_cache
from atom.ops.cuda.reference import paged_decode_attention_ref, rotary_write_kv_ref
from atom.ops.paged_attention import paged_prefill_attention_sdpa

# csrc/paged_attention.cu: a block serves up to 8 query heads of one kv head, and a split takes whole tiles of
# 32 positions. How many blocks an SM holds (shared memory and registers) comes from the CUDA occupancy API.
# Grids that fill half the slots take one split: with fewer blocks an SM each runs faster, and splits add a merge.
# On the H200 (GPU_NOTES, session 36) batch 64 at head_dim 64 and 1024 positions ran at 58.4% of the copy ceiling
# whole, 49.2% in two splits and 44.3% in four; at 0.8 (MLA's rule) its grid (512 blocks, 660 slots) would split.
_HEADS_PER_BLOCK, _TILE, _MIN_FILL = 8, 32, 0.5
# Past one wave, at head_dim 128 and up, a grid that fills under 90% of its waves' slots splits long rows in three,
# each split at least 16 tiles (512 positions); each row takes only the splits its length allows (row_splits in
# csrc/paged_attention.cu), since CUDA graphs size the grid by max_model_len. On the H200, in a graph (GPU_NOTES,
# session 38), head_dim 128 at batch 96-192 (waves 58-78% full): rows of 2048 and 8192 positions 1.06-1.28x faster
# than whole, of 1024 1.00-1.15x; rows of 128 and 512 (one split each) 0.89-0.95x, for the idle blocks and the
# merge's launch (3-8 us). Head_dim 256 at batch 96 (73% full): 1.10-1.11x at 1024 and 4096, 0.95-0.97x at 128 and
# 512; at batch 128 (97% full) it lost everywhere (0.94-0.98x). At head_dim 64 it lost 6-23% up to 1024 positions
# and gained 8% at 4096, so smaller heads keep whole rows.
_LONG_SPLITS, _SPLIT_MIN_TILES, _FULL_WAVES = 3, 16, 0.9


@functools.lru_cache(maxsize=None)
def _blocks_per_sm(head_dim: int, heads_per_block: int, dtype: torch.dtype) -> int:
    return max(1, C().paged_decode_blocks_per_sm(head_dim, heads_per_block, dtype_code(dtype)))


def choose_paged_splits(rows: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, max_seq_len: int,
                        sms: int) -> tuple[int, int]:  # fmt: skip
    """How many blocks share a row's positions, and the fewest tiles a split of a row takes: ``wave_splits`` over
    this kernel's grid (any row splits) up to one wave; past it, ``_LONG_SPLITS`` for long rows of large heads
    when the last wave is far from full."""
    group = heads // kv_heads
    blocks = rows * kv_heads * -(-group // _HEADS_PER_BLOCK)
    slots = sms * _blocks_per_sm(head_dim, min(group, _HEADS_PER_BLOCK), dtype)
    max_tiles = -(-max_seq_len // _TILE)
    past_one_wave = blocks > slots and head_dim >= 128 and max_tiles >= 2 * _SPLIT_MIN_TILES
    if past_one_wave and blocks / (-(-blocks // slots) * slots) < _FULL_WAVES:  # of its waves' slots
        return _LONG_SPLITS, _SPLIT_MIN_TILES
    return wave_splits(blocks, slots, max_tiles, _MIN_FILL), 1


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    scale: float,
    *,
    max_seq_len: int | None = None,
    out_dtype: torch.dtype | None = None,
    num_splits: int | None = None,
    split_min_tiles: int = 1,
    stages: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q . k * scale) @ v over each row's first seq_lens[t] cached positions; [T, H, D].

    q [T, H, D]; block_tables [T, max_blocks] and seq_lens [T] int32/int64 on the device (a host list
    is uploaded here). max_seq_len (host int, an upper bound is fine) sizes the split of long rows
    over SMs without a host sync; by default the block table's capacity. out_dtype: the cache's dtype
    (default) or float32; or ``out`` (contiguous [T, H, D], its dtype wins) is written. stages: tiles of K and V
    in the kernel's shared-memory ring, 1-3 (0: two up to head_dim 128, else one, or one where two do not fit; the
    others are there to test and measure). num_splits (with split_min_tiles: a row takes only as many splits as
    give each that many tiles of 32 positions) forces the split of long rows, else ``choose_paged_splits``.
    """
    rows, heads, dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if not isinstance(seq_lens, torch.Tensor):  # host list: one upload
        max_seq_len = max(seq_lens, default=0) if max_seq_len is None else max_seq_len
        seq_lens = upload(seq_lens, torch.int32, q.device)
    if cache_dim != dim or v_cache.shape != k_cache.shape or heads % kv_heads:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    dtype = k_cache.dtype
    out_dtype = out.dtype if out is not None else out_dtype or dtype
    if out_dtype not in (dtype, torch.float32):
        raise ValueError(f"paged_decode_attention: out_dtype must be float32 or the cache's {dtype}, got {out_dtype}")
    if not kernels_apply(q, k_cache, v_cache, block_tables, seq_lens):
        expected = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale).to(out_dtype)
        return expected if out is None else out.copy_(expected)
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: K and V caches need the same strides, head_dim contiguous")
    q = q.to(dtype).contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.contiguous()
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits, split_min_tiles = choose_paged_splits(rows, heads, kv_heads, dim, dtype, max_seq_len,
                                                          num_sms(q.device))  # fmt: skip
    if out is None:
        out = torch.empty(rows, heads, dim, dtype=out_dtype, device=q.device)
    elif tuple(out.shape) != (rows, heads, dim) or not out.is_contiguous():
        raise ValueError(f"paged_decode_attention: out must be contiguous [{rows}, {heads}, {dim}], "
                         f"got {tuple(out.shape)}")
    o_part = lse_part = None
    if num_splits > 1:
        o_part = torch.empty(rows, num_splits, heads, dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(rows, num_splits, heads, dtype=torch.float32, device=q.device)
    with device_guard(q.device):
        C().paged_decode_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), block_size, block_tables.data_ptr(), block_tables.stride(0),
            dtype_code(block_tables.dtype), seq_lens.data_ptr(), dtype_code(seq_lens.dtype), out.data_ptr(),
            o_part.data_ptr() if o_part is not None else 0, lse_part.data_ptr() if lse_part is not None else 0,
            rows, heads, kv_heads, dim, num_splits, split_min_tiles, stages, float(scale), dtype_code(dtype),
            dtype_code(out_dtype),
            stream_of(q.device),
        )  # fmt: skip
    return out


# csrc/paged_attention.cu: a prefill block serves 64 or 128 (query, head) rows of one kv head (rows // group queries
# a work item). A 128-row block reads each K and V fragment from shared memory once for twice the rows. On the H200
# (GPU_NOTES, session 38) that made MLA's expanded form (q/k rows of 192) 1.14-1.54x faster on sequences of 512 to
# 8192 tokens and about as fast on short ones (16 x 32 after 1000: 0.99-1.00x; 64 x 64, host-bound: 1.00x and
# 0.90x in two runs). At head_dim 128 it gained 1.03-1.13x on sequences of 1024 or more (most of which go to SDPA)
# but lost up to 0.79x on many short ones (64 x 64), and at head_dim 64 it lost almost everywhere. So: 128 rows
# past head_dim 128.
_PREFILL_ROWS, _WIDE_ROWS = 64, 128
BLOCK_ROWS: int | None = None  # forces 64 or 128 rows a prefill block (bench, tests); None: as above
# Sequences with at least this many causal (query, key) pairs go through SDPA on their own: flash attention's
# kernels do a long sequence's work about 2.8x faster than ours (509 against 182 TFLOP/s for one 8192-token
# prompt at head_dim 128 on the H200), which outweighs SDPA's fixed cost (about 150 us a sequence) from about a
# million pairs: 4 prompts of 2048 (2.1M pairs each) took 686 us through SDPA against 836 us, one chunk of 512
# after 3584 (2.0M) 289 against 287 us at head_dim 128 and 132 against 203 us at 64 (GPU_NOTES, session 37).
SDPA_PAIRS = 1 << 20


def causal_pairs(query_len: int, seq_len: int) -> int:
    """(query, key) pairs a chunk of query_len tokens at the end of seq_len attends."""
    return query_len * (seq_len - query_len) + query_len * (query_len + 1) // 2


def prefill_kernel_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``paged_prefill_attention`` runs its kernel on these tensors (else SDPA a sequence at a time)."""
    heads, dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[2]
    return (kernels_apply(q, k_cache) and group <= _PREFILL_ROWS and q.dtype == k_cache.dtype
            and C().paged_prefill_supported(dim, dim, dtype_code(q.dtype)))  # fmt: skip


def split_by_pairs(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                   seqs: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    """``seqs`` split, in order, into those of fewer than ``SDPA_PAIRS`` causal pairs (the prefill kernel's) and
    the others (SDPA's, one at a time)."""
    return _split_by_pairs(tuple(query_start_loc), tuple(seq_lens), tuple(seqs), SDPA_PAIRS)


@functools.lru_cache(maxsize=16)  # every layer of a step asks for the same split
def _split_by_pairs(starts: tuple[int, ...], seq_lens: tuple[int, ...], seqs: tuple[int, ...],
                    sdpa_pairs: int) -> tuple[tuple[int, ...], tuple[int, ...]]:  # fmt: skip
    short = tuple(b for b in seqs if causal_pairs(starts[b + 1] - starts[b], seq_lens[b]) < sdpa_pairs)
    return short, tuple(b for b in seqs if b not in short)


def prefill_block_rows(qk_dim: int) -> int:
    """(query, head) rows of the prefill kernel's blocks for q/k rows of qk_dim (``BLOCK_ROWS`` forces a choice)."""
    if BLOCK_ROWS is not None:
        return BLOCK_ROWS
    return _WIDE_ROWS if qk_dim > 128 else _PREFILL_ROWS


@functools.lru_cache(maxsize=16)  # every layer of a step asks for the same plan
def _prefill_plan(starts: tuple[int, ...], seq_lens: tuple[int, ...], seqs: tuple[int, ...], per_item: int,
                  device: torch.device) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The kernel's work items [n, 4] int32 on ``device`` (block-table row, first token row, queries, first
    position) for ``seqs``, the ones that reach furthest first so that a step's longest items start in the first
    wave; and their count."""
    items = []
    for b in seqs:
        start, end = starts[b], starts[b + 1]
        context = seq_lens[b] - (end - start)
        items += [(b, t, min(per_item, end - t), context + t - start) for t in range(start, end, per_item)]
    items.sort(key=lambda item: -(item[2] + item[3]))
    return upload([x for item in items for x in item], torch.int32, device), len(items)


@functools.lru_cache(maxsize=16)
def _first_rows(firsts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return upload(list(firsts), torch.int32, device)[:, None]  # a [sequences, 1] block table


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: Sequence[int], seq_lens: Sequence[int],
                            seqs: Sequence[int], scale: float, out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """Causal attention of the sequences ``seqs`` of a step into their rows of ``out`` [T, H, D] (other rows are
    left alone): sequence b's queries are q's rows query_start_loc[b] .. query_start_loc[b + 1] - 1, after
    seq_lens[b] - (its query count) cached positions, and attend through block_tables row b (on the device).
    query_start_loc and seq_lens are host lists, as in a step's metadata. The caches hold this step's K and V.
    Sequences of ``SDPA_PAIRS`` or more causal pairs go through SDPA one at a time, the rest in one launch.
    """
    if not prefill_kernel_applies(q, k_cache):
        paged_prefill_attention_sdpa(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, seqs, scale, out)
        return out
    rows, heads, dim = q.shape
    _, block_size, kv_heads, cache_dim = k_cache.shape
    if cache_dim != dim or v_cache.shape != k_cache.shape or heads % kv_heads:
        raise ValueError(f"paged_prefill_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_prefill_attention: K and V caches need the same strides, head_dim contiguous")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"paged_prefill_attention: out must be a contiguous, 16-byte aligned {q.dtype} "
                         f"{tuple(q.shape)}")
    if not q.is_contiguous() or q.data_ptr() % 16:
        q = q.clone(memory_format=torch.contiguous_format)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    short, long = split_by_pairs(query_start_loc, seq_lens, seqs)
    if long:
        paged_prefill_attention_sdpa(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, long, scale, out)
    per_item = prefill_block_rows(dim) // (heads // kv_heads)
    work, num_work = _prefill_plan(tuple(query_start_loc), tuple(seq_lens), short, per_item, q.device)
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    _launch_prefill(q, k_cache.data_ptr(), v_cache.data_ptr(), strides, block_size, block_tables, work, num_work,
                    per_item, out, kv_heads, scale)  # fmt: skip
    return out


def _launch_prefill(q: torch.Tensor, k_ptr: int, v_ptr: int, strides: tuple[int, int, int], block_size: int,
                    block_tables: torch.Tensor, work: torch.Tensor, num_work: int, per_item: int, out: torch.Tensor,
                    kv_heads: int, scale: float) -> None:  # fmt: skip
    """csrc's paged_prefill_attention over K rows at k_ptr and V rows at v_ptr (strides in elements: block, token,
    kv head); q [T, H, Dqk] and out [T, H, Dv] contiguous."""
    if num_work == 0:
        return
    with device_guard(q.device):
        C().paged_prefill_attention(
            q.data_ptr(), k_ptr, v_ptr, *strides, block_size, block_tables.data_ptr(), block_tables.stride(0),
            dtype_code(block_tables.dtype), work.data_ptr(), num_work, per_item, out.data_ptr(), q.shape[1], kv_heads,
            q.shape[2], out.shape[2], float(scale), dtype_code(q.dtype), stream_of(q.device),
        )  # fmt: skip


# MLA's expanded rows as the kernel reads them: one "block" a sequence (its first row's index in the block table), so
# that a position's row is first + position.
_WHOLE_SEQUENCE = 1 << 30


def expanded_kernel_applies(q: torch.Tensor, v_dim: int) -> bool:
    """Whether ``expanded_prefill_attention`` runs its kernel for MLA queries q [T, H, nope + rope] and values of
    v_dim (bf16/fp16, 192 and 128 as in Kimi-Linear and DeepSeek, NVIDIA)."""
    return kernels_apply(q) and C().paged_prefill_supported(q.shape[2], v_dim, dtype_code(q.dtype))


def expanded_prefill_attention(q: torch.Tensor, rows: torch.Tensor, firsts: Sequence[int],
                               query_start_loc: Sequence[int], seq_lens: Sequence[int], seqs: Sequence[int],
                               scale: float, out: torch.Tensor) -> None:  # fmt: skip
    """MLA prefill's causal attention over its expanded keys and values, every sequence of ``seqs`` in one launch
    (the caller keeps the long ones for SDPA: ``split_by_pairs``).

    q [T, H, nope + rope] (the step's queries), out [T, H, v]; rows [P, H, v + nope + rope]: each head's value,
    then its key, for every cached and new row of the sequences, sequence b's seq_lens[b] rows from rows[firsts[b]]
    (firsts: one entry per sequence of the step; only those of ``seqs`` are read). Queries as in
    ``paged_prefill_attention``.
    """
    heads, qk_dim, v_dim = q.shape[1], q.shape[2], out.shape[2]
    if rows.shape[1:] != (heads, v_dim + qk_dim) or not rows.is_contiguous() or rows.data_ptr() % 16:
        raise ValueError(f"expanded_prefill_attention: rows {tuple(rows.shape)} must be contiguous [P, {heads}, "
                         f"{v_dim + qk_dim}], 16-byte aligned")
    if out.shape[:2] != q.shape[:2] or out.dtype != q.dtype or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError(f"expanded_prefill_attention: out must be a contiguous, 16-byte aligned {q.dtype} "
                         f"[{q.shape[0]}, {heads}, v]")
    if not q.is_contiguous() or q.data_ptr() % 16:
        q = q.clone(memory_format=torch.contiguous_format)
    per_item = prefill_block_rows(qk_dim)  # queries: a head a kv head
    work, num_work = _prefill_plan(tuple(query_start_loc), tuple(seq_lens), tuple(seqs), per_item, q.device)
    row = heads * (v_dim + qk_dim)  # elements; a position's row is firsts[b] + position, whole
    _launch_prefill(q, rows.data_ptr() + v_dim * rows.element_size(), rows.data_ptr(), (row, row, v_dim + qk_dim),
                    _WHOLE_SEQUENCE, _first_rows(tuple(firsts), q.device), work, num_work, per_item, out, heads,
                    scale)  # fmt: skip


def write_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] into their caches at slot_mapping[t] (block * block_size + offset); a
    negative slot (a padding row of a decode graph) writes nothing."""
    for cache, new in ((k_cache, k), (v_cache, v)):
        if not cache[0, 0].is_contiguous():
            raise ValueError("write_kv_cache: a cache's token rows must be contiguous")
        rows = cache.flatten(2)  # [num_blocks, block_size, kv_heads * head_dim]
        new = new.flatten(1)
        write_latent_cache(rows, new, new[:, :0], slot_mapping)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The rotated q [T, H, D] (a new tensor); k rotated and v written into the caches at slot_mapping.

    q [T, H, D], k and v [T, Hkv, D] in the caches' dtype, each with its head rows back to back in a token's
    row (views into one qkv projection are fine); positions and slot_mapping [T] int32/int64 (a negative
    slot, a graph's padding row, writes nothing); inv_freq [D / 2] float32. Rounds as
    ``atom.layers.rotary`` does: a token's q and k equal the torch path's up to cos and sin's last bit.
    """
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    if (k.shape != v.shape or k.shape[0] != tokens or k.shape[2] != dim or k_cache.shape[2:] != (kv_heads, dim)
            or v_cache.shape != k_cache.shape or inv_freq.shape != (dim // 2,)):  # fmt: skip
        raise ValueError(f"rotary_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, inv_freq "
                         f"{tuple(inv_freq.shape)} do not fit the caches {tuple(k_cache.shape)}")
    if not kernels_apply(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping):
        return rotary_write_kv_ref(q, k, v, positions, inv_freq, k_cache, v_cache, slot_mapping)
    if not q.dtype == k.dtype == v.dtype == k_cache.dtype or inv_freq.dtype != torch.float32:
        raise ValueError(f"rotary_write_kv: q, k, v must have the caches' dtype {k_cache.dtype} and inv_freq "
                         f"float32; got {q.dtype}, {k.dtype}, {v.dtype}, {inv_freq.dtype}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("rotary_write_kv: K and V caches need the same strides, head_dim contiguous")
    q, k, v = (x if x.stride(2) == 1 and x.stride(1) == dim else x.contiguous() for x in (q, k, v))
    positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
    q_out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    with device_guard(q.device):
        C().rotary_write_kv(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), positions.data_ptr(),
            dtype_code(positions.dtype), inv_freq.contiguous().data_ptr(), q_out.data_ptr(), k_cache.data_ptr(),
            v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
            slot_mapping.data_ptr(), dtype_code(slot_mapping.dtype), tokens, heads, kv_heads, dim,
            dtype_code(q.dtype), stream_of(q.device),
        )  # fmt: skip
    return q_out
