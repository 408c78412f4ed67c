"""KV connectors: a scheduler half and a worker half that speak only through metadata.

Prefill/decode disaggregation (P/D) moves a request's prompt KV blocks and its
recurrent state from a producer (prefill) engine to a consumer (decode) engine.

Scheduler half (policy, runs inside ``Scheduler``; plain data only):
  - ``num_remote_tokens(request)``: consumer: how many prompt tokens arrive from
    a producer (all of them) or 0.
  - ``after_alloc(request)``: consumer: blocks and a slot group are allocated;
    queue a load for the worker half.
  - ``request_finished(request) -> (delay_free, params)``: producer: keep the
    blocks and slot after the request ends and return the ``kv_transfer_params``
    the consumer needs.
  - ``build_metadata() -> ConnectorMetadata``: what the worker half must do now.
  - ``update(ConnectorOutput) -> (loaded, failed, released)``: what the worker
    half reported.

Worker half (mechanism, runs on the rank's event loop): registers cache
memory with the transfer engine, serves the side channel, moves bytes;
``handle(metadata)`` starts work, ``take_output()`` reports what finished.

State handoff: a KDA state is valid for exactly one token count. The producer
hands over the slot holding the state after exactly ``num_prompt_tokens``
(the prompt boundary, after the last prefill chunk); the consumer resumes from
it with the first sampled token as its next input, so the boundary token is
applied to the state once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_KV_BUFFER_SIZE = 1 << 30  # the host buffer when kv_buffer_size is left out (or one request, if more)


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str  # "mooncake"
    kv_role: str  # "kv_producer" | "kv_consumer"
    protocol: str = "tcp"  # "tcp" | "rdma"
    device_name: str = ""
    host: str = "127.0.0.1"  # where this rank's side channel and transfer engine listen
    handshake_port: int = 0  # side-channel port; 0 = the kernel picks one (the bound port is reported)
    kv_load_failure_policy: str = "fail"  # "fail" | "recompute"
    lease_seconds: float = 60.0  # producer frees held blocks if no consumer finishes by then
    transfer_timeout: float = 30.0  # consumer gives up on a load after this long
    # Where Mooncake reads and writes: "cache" (the cache tensors themselves: GPU memory needs Mooncake's
    # CUDA build, or rdma), "cpu" (a host buffer the blocks are gathered into and scattered from), or
    # "auto" ("cpu" when the caches are on a GPU, else "cache").
    kv_buffer_device: str = "auto"
    # Bytes of that host buffer; every transfer in flight takes a region of it. None: 1 GiB, or one request
    # of max_model_len if that is more.
    kv_buffer_size: int | None = None

    def __post_init__(self) -> None:
        if self.kv_connector != "mooncake":
            raise ValueError(f"kv_connector {self.kv_connector!r} is not supported; use 'mooncake'")
        if self.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"kv_role {self.kv_role!r} must be 'kv_producer' or 'kv_consumer'")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol {self.protocol!r} must be 'tcp' or 'rdma'")
        if self.kv_load_failure_policy not in ("fail", "recompute"):
            raise ValueError("kv_load_failure_policy must be 'fail' or 'recompute'")
        if not 0 <= self.handshake_port < 65536:
            raise ValueError("handshake_port must be in [0, 65535]")
        if self.kv_buffer_device not in ("auto", "cpu", "cache"):
            raise ValueError(f"kv_buffer_device {self.kv_buffer_device!r} must be 'auto', 'cpu' or 'cache'")
        size = self.kv_buffer_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
            raise ValueError("kv_buffer_size must be a positive number of bytes (or null: sized to fit)")
        if self.lease_seconds <= 0 or self.transfer_timeout <= 0:
            raise ValueError("lease_seconds and transfer_timeout must be positive")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVTransferConfig":
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown kv_transfer_config key(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    @property
    def is_producer(self) -> bool:
        return self.kv_role == "kv_producer"

    def uses_host_buffer(self, cache_device) -> bool:
        """Whether transfers go through the host buffer for caches on ``cache_device``."""
        if self.kv_buffer_device == "auto":
            return torch.device(cache_device).type != "cpu"
        return self.kv_buffer_device == "cpu"


@dataclass
class LoadSpec:
    """Consumer: pull one request's prompt KV and state into these local blocks/slot."""

    request_id: str
    remote: dict[str, Any]  # the producer's kv_transfer_params
    block_ids: list[int]
    state_slot: int  # first slot of the local group, -1 if the model has no recurrent layers


@dataclass
class HoldSpec:
    """Producer: a finished request's blocks/slot held for a consumer to pull."""

    transfer_id: str
    block_ids: list[int]
    state_slot: int  # the slot holding the state at the prompt boundary, -1 if none
    num_tokens: int
    deadline: float  # time.monotonic() after which the hold lapses


@dataclass
class ConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    holds: list[HoldSpec] = field(default_factory=list)
    cancelled_loads: list[str] = field(default_factory=list)  # request ids aborted while loading


@dataclass
class ConnectorOutput:
    loaded: set[str] = field(default_factory=set)  # consumer: request ids whose KV arrived
    failed: dict[str, str] = field(default_factory=dict)  # consumer: request id -> error
    released: set[str] = field(default_factory=set)  # producer: transfer ids done or expired
