"""The package as installed: kernel loading, the reference path, the csrc build check."""

from __future__ import annotations

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
