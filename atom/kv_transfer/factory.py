"""Build a KV connector's two halves from ``--kv-transfer-config``."""

from __future__ import annotations

import uuid

import torch

from atom.kv_transfer.base import KVTransferConfig


def make_connector(
    config: KVTransferConfig,
    *,
    block_size: int,
    caches: dict[int, tuple[torch.Tensor, ...]],
    cache_kinds: dict[int, str],
    engine_id: str | None = None,
):
    """(scheduler half, worker half). The worker half must be ``await start()``-ed on the
    rank's event loop before the engine reports ready; it binds the side channel and sets
    the scheduler half's ``side_channel_port``."""
    if config.kv_connector == "mooncake":
        from atom.kv_transfer.mooncake import MooncakeConnectorScheduler, MooncakeConnectorWorker

        engine_id = engine_id or uuid.uuid4().hex
        scheduler_half = MooncakeConnectorScheduler(config, engine_id, block_size)
        worker_half = MooncakeConnectorWorker(config, engine_id, caches, cache_kinds, scheduler_half)
        return scheduler_half, worker_half
    raise ValueError(f"kv_connector {config.kv_connector!r} is not supported; use 'mooncake'")
