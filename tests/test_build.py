"""The package as installed: kernel loading, the reference path, the csrc build check."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from atom.ops import cache_ops
from atom.ops._C_loader import get_C, use_kernels

ROOT = Path(__file__).resolve().parents[1]
HAS_NVCC = shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
GPU_TORCH = torch.version.cuda is not None or torch.version.hip is not None
HAS_KERNELS = torch.cuda.is_available() and get_C() is not None and use_kernels()


@pytest.mark.skipif(GPU_TORCH, reason="checks the CPU-only install")
def test_cpu_install_has_no_kernels():
    assert get_C() is None
    assert not use_kernels()


def test_force_reference_env_disables_kernels(monkeypatch):
    monkeypatch.setenv("ATOM_FORCE_REFERENCE", "1")
    assert not use_kernels()
    monkeypatch.setenv("ATOM_FORCE_REFERENCE", "0")
    assert use_kernels() == (GPU_TORCH and get_C() is not None)


def _devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize(
    "block_shape, dtype",
    [
        ((16, 4, 64), torch.bfloat16),  # paged KV block: 16-byte words
        ((3, 5), torch.float32),  # 60 bytes: 4-byte words
        ((7,), torch.uint8),  # odd byte count: 1-byte words
        ((1, 3), torch.float16),  # 6 bytes: 2-byte alignment, falls back to bytes
        ((2, 9, 3), torch.int64),  # 8-byte words
    ],
)
def test_gather_then_scatter_round_trips(device, block_shape, dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks = 37
    cache = torch.randint(0, 100, (num_blocks, *block_shape), generator=g).to(dtype).to(device)
    block_ids = torch.randperm(num_blocks, generator=g)[:11]

    staging = cache_ops.gather_blocks(cache, block_ids.to(device))
    assert staging.shape == (11, *block_shape)
    torch.testing.assert_close(staging, cache[block_ids.to(device)], rtol=0, atol=0)

    fresh = torch.zeros_like(cache)
    dest_ids = torch.randperm(num_blocks, generator=g)[:11]  # blocks move to new places
    cache_ops.scatter_blocks(fresh, dest_ids, staging)
    torch.testing.assert_close(fresh[dest_ids.to(device)], staging, rtol=0, atol=0)
    untouched = torch.ones(num_blocks, dtype=torch.bool)
    untouched[dest_ids] = False
    assert not fresh[untouched.to(device)].any()


@pytest.mark.parametrize("device", _devices())
def test_strided_cache_and_out_buffer(device):
    # K half of a [2, num_blocks, ...] KV cache: dim 0 strided, each block dense.
    kv = torch.randn(2, 9, 4, 8, device=device)
    k_cache = kv[0]
    ids = torch.tensor([8, 0, 3], device=device)
    out = torch.empty(3, 4, 8, device=device)
    assert cache_ops.gather_blocks(k_cache, ids, out=out) is out
    torch.testing.assert_close(out, k_cache[ids], rtol=0, atol=0)

    cache_ops.scatter_blocks(kv[1], ids, out)
    torch.testing.assert_close(kv[1][ids], k_cache[ids], rtol=0, atol=0)


def _packed_places() -> list[tuple[str, str]]:
    """(cache device, where the packed bytes live): on a GPU, its memory, pinned host memory (the
    kernel reaches it at its mapped address) and pageable host memory (the torch reference)."""
    places = [("cpu", "cpu")]
    if torch.cuda.is_available():
        places += [("cuda", "cuda"), ("cuda", "pinned"), ("cuda", "pageable")]
    return places


@pytest.mark.parametrize("device,place", _packed_places())
def test_gather_and_scatter_parts_match_explicit_indexing(device, place, monkeypatch):
    """A request's units of several cache tensors in one buffer: 16-byte runs, odd-sized units (byte
    runs), a unit longer than a run (spread over several), the strided K half of a KV cache, a part
    with no units; poisoned buffers, so a byte written where it should not be shows. Host buffers
    are a slice inside a larger one, as the P/D host buffer's regions are."""
    launches = []
    inner = cache_ops.launch_runs
    monkeypatch.setattr(cache_ops, "launch_runs", lambda *a, **kw: (launches.append(kw["gather"]), inner(*a, **kw)))
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 21, 16, 8, generator=g)
    caches = [kv[0], torch.randn(21, 16, 24, generator=g).to(torch.bfloat16),
              torch.randint(0, 255, (6, 7, 3), generator=g).to(torch.uint8),  # 21 bytes a unit
              torch.randn(6, 130, 130, generator=g),  # 67600 bytes: 2 runs of at most 64 KiB
              torch.randn(6, 5, generator=g).to(torch.float16)]
    ids = [[20, 3, 9, 0], [20, 3, 9, 0], [4], [1], []]
    caches = [c.to(device) for c in caches]
    parts = list(zip(caches, ids))
    starts, at = [], 0
    for cache, unit_ids in parts:
        at = -(-at // 16) * 16
        starts.append(at)
        at += len(unit_ids) * math.prod(cache.shape[1:]) * cache.element_size()
    if place in ("pinned", "pageable"):
        outer = torch.full((at + 16 + 4096,), 0xAB, dtype=torch.uint8, pin_memory=place == "pinned")
        packed = outer[256 : 256 + at + 16]
    else:
        packed = torch.full((at + 16,), 0xAB, dtype=torch.uint8, device=place)
    cache_ops.gather_parts(parts, packed, starts)
    if device == "cuda":
        torch.cuda.synchronize()  # the kernel writes pinned host bytes asynchronously
    covered = torch.zeros(at + 16, dtype=torch.bool)
    for (cache, unit_ids), start in zip(parts, starts):
        n = len(unit_ids) * math.prod(cache.shape[1:]) * cache.element_size()
        got = packed[start : start + n].view(cache.dtype).view(len(unit_ids), *cache.shape[1:])
        assert torch.equal(got.cpu(), cache.cpu()[unit_ids])
        covered[start : start + n] = True
    assert (packed.cpu()[~covered] == 0xAB).all()  # the gaps and the tail untouched
    # Back into other units of poisoned caches: only those change.
    fresh = [torch.full_like(c, 7 if c.dtype == torch.uint8 else float("nan")) for c in caches]
    dest = [[1, 2, 5, 19], [0, 20, 4, 6], [5], [0], []]
    cache_ops.scatter_parts(list(zip(fresh, dest)), packed, starts)
    if place in ("pinned", "pageable"):
        assert (outer[:256] == 0xAB).all() and (outer[256 + at + 16 :] == 0xAB).all()  # nothing outside the slice
    for got, cache, src_ids, dst_ids in zip(fresh, caches, ids, dest):
        got, cache = got.cpu(), cache.cpu()
        assert torch.equal(got[dst_ids], cache[src_ids])
        others = [i for i in range(got.shape[0]) if i not in dst_ids]
        assert (got[others] == 7).all() if got.dtype == torch.uint8 else got[others].isnan().all()
    kernel = device == "cuda" and place != "pageable" and HAS_KERNELS
    assert launches == ([True, False] if kernel else [])  # one copy_runs launch each way, or the reference


def _packed_starts(caches: list[torch.Tensor], ids: list[list[int]]) -> tuple[list[int], int]:
    """Each cache's part start in the packed bytes (16-byte aligned), and where they end."""
    starts, at = [], 0
    for cache, unit_ids in zip(caches, ids):
        at = -(-at // 16) * 16
        starts.append(at)
        at += len(unit_ids) * cache[0].numel() * cache.element_size()
    return starts, at


def test_run_list_applied_byte_by_byte_moves_what_indexing_moves():
    """The run list the copy_runs kernel follows, carried out here with memmove on host tensors: the
    same bytes as explicit indexing, each run at most RUN_BYTES, no two runs writing the same byte."""
    g = torch.Generator().manual_seed(5)
    caches = [torch.randn(12, 2, 16, 9, generator=g)[:, 1],  # V of a [blocks, 2, ...] cache: units a stride apart
              torch.randn(12, 16, 5, generator=g).to(torch.bfloat16),
              torch.randn(4, 150, 150, generator=g),  # 90000 bytes a unit: two runs
              torch.randint(0, 255, (4, 7), generator=g).to(torch.uint8), torch.empty(4, 0)]
    plan = cache_ops.RunPlan(caches, [0, 0, 1, 1, 1])
    ids = [[11, 2, 7], [3]]
    starts, at = _packed_starts(caches, [ids[group] for group in plan.groups])
    packed = torch.full((at,), 0xAB, dtype=torch.uint8)
    runs = plan.run_list(ids, packed.data_ptr(), starts, gather=True)
    assert (runs[:, 2] > 0).all() and (runs[:, 2] <= cache_ops.RUN_BYTES).all()
    spans = sorted((int(dst), int(dst + n)) for _, dst, n in runs)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
    for src, dst, n in runs:
        ctypes.memmove(int(dst), int(src), int(n))
    want = torch.full_like(packed, 0xAB)
    plan.gather(ids, want, starts)  # the torch reference on host tensors
    assert torch.equal(packed, want)
    fresh = [torch.zeros(12, 2, 16, 9)[:, 1]] + [torch.zeros_like(c) for c in caches[1:]]
    back = cache_ops.RunPlan(fresh, plan.groups)
    for src, dst, n in back.run_list([[0, 5, 9], [1]], packed.data_ptr(), starts, gather=False):
        ctypes.memmove(int(dst), int(src), int(n))
    for got, cache, group in zip(fresh, caches, plan.groups):
        dest = [[0, 5, 9], [1]][group]
        assert torch.equal(got[dest], cache[ids[group]])
        assert not got[[i for i in range(len(got)) if i not in dest]].any()


@pytest.mark.parametrize("window", [1000, 4096, 1 << 20])
def test_windows_through_a_small_buffer_move_what_indexing_moves(window):
    """A request larger than the mover's device buffer goes through it a window at a time
    (``runs_within``): carried out with memmove through a host buffer of ``window`` bytes, gathering
    and scattering give the bytes explicit indexing gives; windows that cut runs included."""
    g = torch.Generator().manual_seed(6)
    caches = [torch.randn(12, 2, 16, 9, generator=g)[:, 0], torch.randn(4, 150, 150, generator=g),
              torch.randint(0, 255, (4, 7), generator=g).to(torch.uint8)]
    plan = cache_ops.RunPlan(caches, [0, 1, 1])
    ids = [[3, 11, 0], [2]]
    starts, at = _packed_starts(caches, [ids[group] for group in plan.groups])
    staging = torch.zeros(window, dtype=torch.uint8)
    packed = torch.zeros(at, dtype=torch.uint8)
    runs = plan.run_list(ids, 0, starts, gather=True)  # the packed side as offsets
    for start in range(0, at, window):
        end = min(start + window, at)
        for src, dst, n in cache_ops.runs_within(runs, 1, start, end, staging.data_ptr()):
            assert staging.data_ptr() <= dst and dst + n <= staging.data_ptr() + end - start
            ctypes.memmove(int(dst), int(src), int(n))
        packed[start:end] = staging[: end - start]
    want = torch.zeros(at, dtype=torch.uint8)
    plan.gather(ids, want, starts)
    assert torch.equal(packed, want)
    fresh = [torch.zeros(12, 2, 16, 9)[:, 0], torch.zeros(4, 150, 150), torch.zeros(4, 7, dtype=torch.uint8)]
    back = cache_ops.RunPlan(fresh, plan.groups)
    dest = [[5, 1, 7], [3]]
    runs = back.run_list(dest, 0, starts, gather=False)
    for start in range(0, at, window):
        end = min(start + window, at)
        staging[: end - start] = packed[start:end]
        for src, dst, n in cache_ops.runs_within(runs, 0, start, end, staging.data_ptr()):
            ctypes.memmove(int(dst), int(src), int(n))
    for got, cache, group in zip(fresh, caches, plan.groups):
        assert torch.equal(got[dest[group]], cache[ids[group]])
        assert not got[[i for i in range(len(got)) if i not in dest[group]]].any()


@pytest.mark.skipif(not HAS_KERNELS, reason="needs a CUDA GPU and a built atom._C")
def test_mapped_address_of_pinned_memory_and_a_clear_error_otherwise():
    pinned = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)
    base = get_C().mapped_address(pinned.data_ptr())
    assert get_C().mapped_address(pinned[4096:].data_ptr()) == base + 4096  # a region inside the buffer
    with pytest.raises(RuntimeError, match="mapped_address"):
        get_C().mapped_address(torch.empty(1 << 16, dtype=torch.uint8).data_ptr())  # pageable


def test_empty_block_ids():
    cache = torch.randn(4, 3)
    staging = cache_ops.gather_blocks(cache, torch.empty(0, dtype=torch.int64))
    assert staging.shape == (0, 3)
    cache_ops.scatter_blocks(cache, torch.empty(0, dtype=torch.int64), staging)


def test_staging_shape_mismatch_names_the_fix():
    cache = torch.randn(4, 3)
    with pytest.raises(ValueError, match="one row per block id"):
        cache_ops.scatter_blocks(cache, torch.tensor([0, 1]), torch.randn(3, 3))
    with pytest.raises(ValueError, match="integer"):
        cache_ops.gather_blocks(cache, torch.tensor([0.0]))


@pytest.mark.slow
@pytest.mark.skipif(not HAS_NVCC, reason="nvcc not installed")
def test_csrc_compiles_with_nvcc():
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci" / "check_cuda_build.sh")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled csrc/cache_ops.cu" in proc.stdout
    if shutil.which("hipcc"):  # every AMD target whose compiler is here was built, none skipped quietly
        for compiler, target in (("hipcc", "gfx90a + gfx940"), ("clang-19", "gfx942"), ("clang-22", "gfx950")):
            if shutil.which(compiler):
                assert f"compiled csrc/mla.cu ({compiler}, {target}" in proc.stdout, proc.stdout
