"""Shared fixtures: small checkpoints built once per session, and the leak check.

Every engine a test creates through ``make_llm`` is checked after the test:
when no request is alive, every KV block and state slot must be free.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import checkpoints

# The models here are tiny: one intra-op thread is faster than two fighting over
# 2 cores, and keeps timings steady. Subprocesses (CLI, P/D ranks) inherit it.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def kimi_ckpt(tmp_path_factory) -> str:
    return checkpoints.make_kimi_checkpoint(str(tmp_path_factory.mktemp("kimi")), "kda_mla")


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory) -> str:
    return checkpoints.make_llama_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama")


@pytest.fixture(scope="session")
def qwen3_ckpt(tmp_path_factory) -> str:
    return checkpoints.make_llama_checkpoint(str(tmp_path_factory.mktemp("qwen3")), "qwen3")


@pytest.fixture
def make_llm():
    from atom import LLM

    made = []

    def factory(model: str, **kwargs):
        kwargs.setdefault("dtype", "float32")
        llm = LLM(model, **kwargs)
        made.append(llm)
        return llm

    yield factory
    for llm in made:
        assert not llm.engine.has_unfinished_requests(), "a request is still alive after the test"
        assert llm.engine.all_resources_free(), "KV blocks or state slots leaked"


@pytest.fixture
def kernel_shaped_layers(monkeypatch):
    """The layers' GPU decode path on the CPU: the kernel wrappers fall back to their references."""
    from atom.layers import kda, moe
    from atom.ops import cuda as kernels

    for module in (kda, moe, kernels):
        monkeypatch.setattr(module, "kernels_apply", lambda *tensors: True)
