"""Size the KV block pool and the state-slot pool from a memory budget.

The state pool is reserved first (one group of 1 + k slots per request the
scheduler may run at once); the rest of the budget becomes KV blocks. Start-up
fails, naming the flag to change, if one max-length request cannot fit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from atom.config import EngineConfig
from atom.layers.cache_spec import CacheSpec, RecurrentStateSpec

logger = logging.getLogger(__name__)

MAX_DEFAULT_KV_CACHE_MEMORY = 1 << 30  # cap when neither a budget nor a block count is given


@dataclass(frozen=True)
class CacheLayout:
    num_blocks: int
    num_state_groups: int
    bytes_per_block: int
    bytes_per_state_group: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_state_groups * self.bytes_per_state_group


def plan_cache(config: EngineConfig, specs: dict[int, CacheSpec]) -> CacheLayout:
    recurrent = [s for s in specs.values() if isinstance(s, RecurrentStateSpec)]
    paged = [s for s in specs.values() if not isinstance(s, RecurrentStateSpec)]
    per_block = sum(s.bytes_per_block(config.block_size) for s in paged)
    per_group = sum(s.bytes_per_slot() for s in recurrent) * config.slots_per_request
    groups = (config.num_state_slots or config.max_num_seqs) if recurrent else 0
    if config.num_gpu_blocks is not None:
        blocks = config.num_gpu_blocks
    else:
        budget = config.kv_cache_memory or _default_budget(config, per_block, groups * per_group)
        left = budget - groups * per_group
        if recurrent and left < 0:
            groups = budget // per_group if per_group else groups
            left = budget - groups * per_group
        blocks = left // per_block if per_block else 1
    layout = CacheLayout(int(blocks), int(groups), per_block, per_group)
    _check_fits(config, layout, bool(paged), bool(recurrent))
    logger.info(
        "cache: %d blocks of %d tokens, %d state groups, %.1f MiB",
        layout.num_blocks, config.block_size, layout.num_state_groups, layout.total_bytes / 2**20,
    )
    return layout


def _default_budget(config: EngineConfig, per_block: int, state_bytes: int) -> int:
    """Room for max_num_seqs requests of max_model_len each, capped at 1 GiB; no more is useful."""
    want = config.max_num_seqs * config.max_blocks_per_seq * per_block + state_bytes
    floor = config.max_blocks_per_seq * per_block + state_bytes
    return max(min(want, MAX_DEFAULT_KV_CACHE_MEMORY), floor)


def _check_fits(config: EngineConfig, layout: CacheLayout, paged: bool, recurrent: bool) -> None:
    need_blocks = config.max_blocks_per_seq
    if paged and layout.num_blocks < need_blocks:
        need = need_blocks * layout.bytes_per_block + (layout.bytes_per_state_group if recurrent else 0)
        raise ValueError(
            f"the KV cache holds {layout.num_blocks} blocks but one request of max_model_len="
            f"{config.max_model_len} needs {need_blocks}; raise --kv-cache-memory to at least "
            f"{need} bytes (or --num-gpu-blocks-override to {need_blocks}), or lower --max-model-len"
        )
    if recurrent and layout.num_state_groups < 1:
        raise ValueError(
            f"no room for one recurrent-state slot group ({layout.bytes_per_state_group} bytes); "
            "raise --kv-cache-memory"
        )


def available_memory(device) -> int | None:
    """Bytes free on the device (GPU) or in the machine (CPU), or None if unknown."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_room(layout: CacheLayout, device) -> None:
    """With the model loaded, the cache pools must still fit in what is free."""
    free = available_memory(device)
    if free is not None and layout.total_bytes > free:
        raise ValueError(
            f"the KV cache and state slots need {layout.total_bytes / 2**20:.0f} MiB but only "
            f"{free / 2**20:.0f} MiB is free on {device} after loading the model; lower --kv-cache-memory, "
            "--max-num-seqs or --max-model-len"
        )

