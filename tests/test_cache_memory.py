"""Sizing the cache pools: every state group gets a max-length request's KV blocks.

Kimi-Linear-48B-A3B's shape (from config.json alone; the model is built on
the meta device, so no weights) keeps ~41 MiB of recurrent state per request:
at 64 requests the state alone outgrows the 1 GiB default budget of the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

from atom.config import EngineConfig
from atom.models.registry import get_model_class
from atom.worker.cache_memory import MAX_DEFAULT_KV_CACHE_MEMORY, plan_cache

KIMI_48B = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "num_hidden_layers": 27,
            "linear_attn_config": {"kda_layers": [n for n in range(1, 28) if n % 4 and n != 27],
                                   "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "num_heads": 32, "head_dim": 128,
                                   "short_conv_kernel_size": 4},
            "max_position_embeddings": 4096, "dtype": "bfloat16"}  # the rest: the release's values (our defaults)


@pytest.fixture(scope="module")
def kimi_48b(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("kimi_48b")
    (folder / "config.json").write_text(json.dumps(KIMI_48B))
    return str(folder)


def _plan(folder: str, **kwargs):
    config = EngineConfig(model=folder, load_format="dummy", **kwargs)
    with torch.device("meta"):
        specs = get_model_class(config.architecture)(config.hf_config, config.torch_dtype).cache_specs()
    return config, plan_cache(config, specs)


def _requests_with_blocks(config, layout) -> int:
    return layout.num_blocks // config.max_blocks_per_seq


def test_default_budget_gives_each_state_group_its_blocks(kimi_48b):
    config, layout = _plan(kimi_48b, max_num_seqs=64, max_model_len=200)
    assert 40 << 20 < layout.bytes_per_state_group < 42 << 20  # 20 KDA layers: 2 MiB of fp32 state + conv each
    # 64 groups need ~2.6 GiB, more than the CPU's 1 GiB: fewer groups, each with a full request's blocks (before,
    # 64 groups took the budget and left blocks for one request, so requests ran one at a time)
    assert layout.total_bytes <= MAX_DEFAULT_KV_CACHE_MEMORY
    assert 20 <= layout.num_state_groups < 64
    assert _requests_with_blocks(config, layout) >= layout.num_state_groups


@pytest.mark.parametrize("budget", [1 << 30, 300 << 20])
def test_explicit_budget_is_split_the_same_way(kimi_48b, budget):
    config, layout = _plan(kimi_48b, max_num_seqs=64, max_model_len=512, kv_cache_memory=budget)
    per_request = config.max_blocks_per_seq * layout.bytes_per_block + layout.bytes_per_state_group
    assert layout.num_state_groups == budget // per_request
    assert _requests_with_blocks(config, layout) >= layout.num_state_groups
    assert layout.total_bytes <= budget


def test_room_for_every_request_keeps_every_group(kimi_48b):
    config, layout = _plan(kimi_48b, max_num_seqs=8, max_model_len=1024)
    assert layout.num_state_groups == 8 and _requests_with_blocks(config, layout) == 8  # want: no more, no less
    config, layout = _plan(kimi_48b, max_num_seqs=64, max_model_len=200, kv_cache_memory=4 << 30)
    assert layout.num_state_groups == 64 and _requests_with_blocks(config, layout) >= 64


def test_too_small_for_one_request_names_the_flag(kimi_48b):
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        _plan(kimi_48b, max_num_seqs=4, max_model_len=4096, kv_cache_memory=40 << 20)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_default_budget_comes_from_free_memory(kimi_48b):
    # on a GPU the cap is 90% of the free memory, not 1 GiB: all 64 requests fit (~2.7 GiB)
    config, layout = _plan(kimi_48b, max_num_seqs=64, max_model_len=200, device="cuda")
    assert layout.num_state_groups == 64 and _requests_with_blocks(config, layout) >= 64
    assert layout.total_bytes > MAX_DEFAULT_KV_CACHE_MEMORY
