"""Prefill/decode disaggregation over the Mooncake transfer engine (see atom/kv_transfer/base.py)."""

from atom.kv_transfer.mooncake.scheduler_side import MooncakeConnectorScheduler
from atom.kv_transfer.mooncake.worker_side import MooncakeConnectorWorker

__all__ = ["MooncakeConnectorScheduler", "MooncakeConnectorWorker"]
