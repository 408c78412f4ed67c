"""Dispatch to the ``atom._C`` CUDA/HIP kernels, with a torch reference for each.

Every function here takes torch tensors, runs the compiled kernel when the
tensors are on a GPU and ``use_kernels()`` (``ATOM_FORCE_REFERENCE=1`` turns
that off), and its torch reference (``reference.py``) everywhere else. The
kernels take raw device pointers and the current stream, so nothing here
links against torch's C++ ABI.

    kda_decode            KDA decode step over the slot-indexed fp32 state (1 + k tokens)
    kda_prefill           KDA prefill of varlen packed sequences, chunked (ours, or fla's chunk_kda)
    conv1d_update         short causal conv1d + SiLU over the slot-indexed conv state
    conv1d_prefill        the same over packed prefill sequences
    gated_rmsnorm         weight * rmsnorm(x) * sigmoid(gate)
    mla_decode            MLA absorbed decode attention over the paged latent cache
    write_latent_cache    MLA cache rows [latent | k_rot] at slot_mapping
    paged_decode_attention  GQA decode attention of dense models over paged K and V caches
    paged_prefill_attention  their prefill chunks' causal attention, every sequence of a step in one launch
    write_kv_cache        dense models' K and V cache rows at slot_mapping
    rotary_write_kv       neox rotary on q and k, the rotated k and v into the caches: one kernel
    sample_tokens         one token per logits row: temperature, top-k, top-p, min-p, exponential race
    sample_residual       the same with a draft per row: its probability, and the race without it
    keyed_draws_          seeded requests' Exp(1) draws, each row from its key alone, in one launch

``kernels_apply(*tensors)`` says whether the kernels run on given tensors
(layers use it to pick the kernel-shaped path).

Whole-block gathers/scatters for P/D and offload live in ``atom.ops.cache_ops``; dense linears at decode
batch sizes (``csrc/gemv.cu``) in ``atom.ops.cuda.linear``, which the layers' ``Linear`` calls.
"""

from atom.ops.cuda._launch import kernels_apply
from atom.ops.cuda.kda import conv1d_prefill, conv1d_update, kda_decode
from atom.ops.cuda.kda_prefill import kda_prefill
from atom.ops.cuda.mla import mla_decode, write_latent_cache
from atom.ops.cuda.norm import gated_rmsnorm
from atom.ops.cuda.paged_attention import (paged_decode_attention, paged_prefill_attention, rotary_write_kv,
                                          write_kv_cache)
from atom.ops.cuda.sampling import keyed_draws_, sample_residual, sample_tokens

__all__ = ["kernels_apply", "kda_decode", "kda_prefill", "conv1d_update", "conv1d_prefill", "gated_rmsnorm",
           "mla_decode", "write_latent_cache", "paged_decode_attention", "paged_prefill_attention", "write_kv_cache",
           "rotary_write_kv", "sample_residual", "sample_tokens", "keyed_draws_"]
