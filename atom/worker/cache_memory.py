"""Size the KV block pool and the state-slot pool from a memory budget.

The state pool is reserved first (one group of 1 + k slots per request the
scheduler may run at once); the rest of the budget becomes KV blocks. When the
budget cannot hold every group with a max-length request's blocks, there are
fewer groups, each with those blocks (Kimi-Linear-48B's state is ~41 MiB a
request: 64 groups alone outgrow a 1 GiB budget). Start-up fails, naming the
flag to change, if one max-length request cannot fit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from atom.config import EngineConfig
from atom.layers.cache_spec import CacheSpec, RecurrentStateSpec

logger = logging.getLogger(__name__)

MAX_DEFAULT_KV_CACHE_MEMORY = 1 << 30  # cap off the GPU when neither a budget nor a block count is given
DEFAULT_GPU_CACHE_SHARE = 0.9  # on a GPU, of the memory free after loading the model


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
        # one request at max_model_len: its blocks and, with recurrent layers, its state group
        per_request = config.max_blocks_per_seq * per_block + per_group
        want = config.max_num_seqs * config.max_blocks_per_seq * per_block + groups * per_group
        budget = config.kv_cache_memory or _default_budget(config, want, per_request)
        if recurrent and groups * per_request > budget:
            # Fewer groups, each with a full request's blocks: state groups without blocks to run in (or
            # blocks without a state) would only sit idle. (per_request > 0: it holds a state group.)
            fitting = max(budget // per_request, 1)
            logger.warning(
                "the cache budget (%.0f MiB) holds %d requests of max_model_len=%d at once, not max_num_seqs=%d;"
                " raise --kv-cache-memory to %d bytes, or lower --max-num-seqs or --max-model-len",
                budget / 2**20, fitting, config.max_model_len, config.max_num_seqs, groups * per_request,
            )
            groups = fitting
        left = budget - groups * per_group
        blocks = max(left, 0) // per_block if per_block else 1
    layout = CacheLayout(int(blocks), int(groups), per_block, per_group)
    _check_fits(config, layout, bool(paged), bool(recurrent))
    logger.info(
        "cache: %d blocks of %d tokens, %d state groups, %.1f MiB",
        layout.num_blocks, config.block_size, layout.num_state_groups, layout.total_bytes / 2**20,
    )
    return layout


def _default_budget(config: EngineConfig, want: int, per_request: int) -> int:
    """``want`` (room for max_num_seqs requests of max_model_len each: no more is useful) within a cap: on a
    GPU 90% of the memory free once the model is loaded (the rest for activations and graphs), elsewhere
    1 GiB. Never less than one request's room."""
    cap = MAX_DEFAULT_KV_CACHE_MEMORY
    if config.device.startswith("cuda"):
        cap = int(DEFAULT_GPU_CACHE_SHARE * (available_memory(config.device) or 0))
    return max(min(want, cap), per_request)


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

