"""The Mooncake connector's scheduler half: P/D policy, plain data only.

Producer: a request that asked for ``{"do_remote_decode": true}`` and finished
normally keeps its blocks and state-slot group (``request_finished`` returns
``delay_free=True``) until the worker half reports its transfer id released (the
consumer said Done, or the lease ran out). Its ``kv_transfer_params`` tell the
consumer where to pull from.

Consumer: a request carrying those params loads its whole prompt from the producer
(``num_remote_tokens``); once blocks and a slot group are allocated
(``after_alloc``) the worker half pulls, and ``update`` reports the outcome.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any

import msgspec

from atom.engine.request import Request, RequestStatus
from atom.kv_transfer.base import ConnectorMetadata, ConnectorOutput, HoldSpec, KVTransferConfig, LoadSpec

logger = logging.getLogger(__name__)

_NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class RemoteParams(msgspec.Struct):
    """The producer's kv_transfer_params as a consumer receives them (extra keys are ignored)."""

    transfer_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    engine_id: str
    remote_host: Annotated[str, msgspec.Meta(min_length=1)]
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    num_tokens: Annotated[int, msgspec.Meta(ge=1)]
    block_ids: list[_NonNegInt]
    state_slot: Annotated[int, msgspec.Meta(ge=-1)]
    first_token: _NonNegInt
    draft_token_ids: list[_NonNegInt] = []


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class MooncakeConnectorScheduler:
    def __init__(self, kv_config: KVTransferConfig, engine_id: str, block_size: int) -> None:
        self.kv_config = kv_config
        self.engine_id = engine_id
        self.block_size = block_size
        self.is_producer = kv_config.is_producer
        # Set by the worker half once its listener is bound, before the engine reports ready.
        self.side_channel_port: int | None = None
        # Producer: transfer id -> the finished request whose blocks/slot are held for it.
        self.held_requests: dict[str, Request] = {}
        self._loads: list[LoadSpec] = []
        self._holds: list[HoldSpec] = []
        self._cancelled: list[str] = []

    # -- consumer ------------------------------------------------------------------
    def num_remote_tokens(self, request: Request) -> int:
        """Prompt tokens that arrive from a producer: all of them, or 0. Raises ValueError
        (the client's mistake) for params that are not a producer's."""
        params = request.kv_transfer_params
        if params is None:
            return 0
        if self.is_producer:
            if set(params) - {"do_remote_decode"} or not isinstance(params.get("do_remote_decode", False), bool):
                raise ValueError('a kv_producer takes kv_transfer_params {"do_remote_decode": true} only')
            if params.get("do_remote_decode") and request.sampling_params.max_tokens != 1:
                # The hand-off is at the prompt's end: a second step would move the recurrent state past it.
                raise ValueError(
                    'kv_transfer_params {"do_remote_decode": true} hands the request to a consumer after its first '
                    f"token: set max_tokens to 1 (got {request.sampling_params.max_tokens}), as the router does")
            return 0
        if "transfer_id" not in params:
            raise ValueError("this engine is a kv_consumer: kv_transfer_params must be the ones the prefill "
                             "(kv_producer) engine returned")
        try:
            remote = msgspec.convert(params, RemoteParams)
        except msgspec.ValidationError as e:
            raise ValueError(
                f"invalid kv_transfer_params: {e}; pass the kv_transfer_params the prefill engine returned, unchanged"
            ) from None
        if remote.num_tokens != request.num_prompt_tokens:
            raise ValueError(
                f"kv_transfer_params are for a {remote.num_tokens}-token prompt but this prompt has "
                f"{request.num_prompt_tokens} tokens; send the decode engine the same prompt as the prefill engine"
            )
        expected = cdiv(remote.num_tokens, self.block_size)
        if len(remote.block_ids) != expected:
            raise ValueError(
                f"kv_transfer_params name {len(remote.block_ids)} blocks for {remote.num_tokens} tokens, but "
                f"block_size {self.block_size} needs {expected}; run prefill and decode with the same block size"
            )
        return request.num_prompt_tokens

    def after_alloc(self, request: Request) -> None:
        if self.is_producer:
            return
        slot = request.state_slot if request.state_slot is not None else -1
        self._loads.append(LoadSpec(request.request_id, dict(request.kv_transfer_params),
                                    list(request.block_ids), slot))

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted while loading; the worker still reports the load (as failed)
        once nothing can write into its blocks anymore."""
        self._cancelled.append(request_id)

    # -- producer ------------------------------------------------------------------
    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Producer: hold a normally finished ``do_remote_decode`` request for a consumer.
        Returns (delay_free, kv_transfer_params)."""
        params = request.kv_transfer_params
        if not (self.is_producer and isinstance(params, dict) and params.get("do_remote_decode") is True):
            return False, None
        finished_normally = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        if not finished_normally or not request.output_token_ids:
            return False, None
        # The one sampled token was never fed back, so the state (and the KV) cover exactly
        # the prompt: that is the token count the consumer resumes from.
        if request.num_computed_tokens != request.num_prompt_tokens:
            raise RuntimeError(
                f"P/D producer invariant broken: request {request.request_id} finished with "
                f"num_computed_tokens={request.num_computed_tokens} != num_prompt_tokens="
                f"{request.num_prompt_tokens}; its state is not at the prompt boundary"
            )
        if self.side_channel_port is None:
            raise RuntimeError("P/D producer invariant broken: a request finished before the side channel was bound")
        num_blocks = cdiv(request.num_prompt_tokens, self.block_size)
        if len(request.block_ids) < num_blocks:
            raise RuntimeError(
                f"P/D producer invariant broken: request {request.request_id} has {len(request.block_ids)} "
                f"blocks for {request.num_prompt_tokens} prompt tokens (block_size {self.block_size})"
            )
        state_slot = request.state_slot + request.state_offset if request.state_slot is not None else -1
        transfer_id = uuid.uuid4().hex
        out = {
            "transfer_id": transfer_id,
            "engine_id": self.engine_id,
            "remote_host": self.kv_config.host,
            "remote_port": self.side_channel_port,
            "num_tokens": request.num_prompt_tokens,
            "block_ids": list(request.block_ids[:num_blocks]),
            "state_slot": state_slot,
            "first_token": request.output_token_ids[0],
            "draft_token_ids": list(request.spec_token_ids),
        }
        deadline = time.monotonic() + self.kv_config.lease_seconds
        self._holds.append(HoldSpec(transfer_id, list(request.block_ids), state_slot,
                                    request.num_prompt_tokens, deadline))
        self.held_requests[transfer_id] = request
        return True, out

    # -- both ----------------------------------------------------------------------
    def build_metadata(self, hold_loads: bool = False) -> ConnectorMetadata:
        """What the worker half must do now. ``hold_loads``: keep the queued loads (and cancellations
        of them) for a later call, while a step that may still write into their blocks runs."""
        if hold_loads:
            held = {load.request_id for load in self._loads}
            meta = ConnectorMetadata(holds=self._holds, cancelled_loads=[r for r in self._cancelled if r not in held])
            self._holds, self._cancelled = [], [r for r in self._cancelled if r in held]
            return meta
        meta = ConnectorMetadata(loads=self._loads, holds=self._holds, cancelled_loads=self._cancelled)
        self._loads, self._holds, self._cancelled = [], [], []
        return meta

    def update(self, out: ConnectorOutput) -> tuple[set[str], dict[str, str], list[Request]]:
        """(loaded request ids, failed request id -> error, held requests now free to release)."""
        released = []
        for transfer_id in out.released:
            request = self.held_requests.pop(transfer_id, None)
            if request is None:
                raise RuntimeError(f"P/D invariant broken: the worker released unknown transfer {transfer_id}")
            released.append(request)
        return set(out.loaded), dict(out.failed), released
