"""The P/D side channel: a small asyncio TCP protocol between consumer and producer.

Every frame is a 4-byte big-endian length followed by one msgpack message, at most
``MAX_FRAME_BYTES``. Messages are msgspec Structs in a tagged union (``"type"``),
decoded with a schema check (types, ranges, no unknown fields): nothing is unpickled
and nothing unchecked reaches the connector.

One load, one connection::

    consumer                                  producer
      Pull{transfer_id, layout, dst...}  ->     validate, write KV with Mooncake
                                        <-    Reply{ok | error}
      Done{transfer_id}                  ->     release the hold
                                        <-    Reply{ok | error}

The server answers every message with a Reply. A frame it cannot accept (too large,
not msgpack, wrong schema, a Reply sent to it) or a request it refuses gets an error
Reply when the socket still takes one, and the connection is closed; the server goes
on serving others.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Annotated, Union

import msgspec

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20
IDLE_TIMEOUT_S = 30.0  # the server drops a connection that sends nothing for this long
WRITE_TIMEOUT_S = 10.0

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class TensorLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered cache tensor: base address, bytes per block (or slot), how many."""

    addr: NonNegInt
    unit_bytes: Annotated[int, msgspec.Meta(gt=0)]
    num_units: NonNegInt


class HostRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A registered run of the consumer's host buffer (staging.py)."""

    addr: NonNegInt
    nbytes: Annotated[int, msgspec.Meta(gt=0)]


class Pull(msgspec.Struct, tag="pull", tag_field="type", frozen=True, forbid_unknown_fields=True):
    """Consumer -> producer: write transfer ``transfer_id`` into these blocks and slot, or, when
    ``dst_packed`` is set, packed into that region of the consumer's host buffer (staging.py).

    ``budget_s``: the producer starts no write after this long from receipt, so that no
    write lands after the consumer has given up and reused the blocks."""

    transfer_id: TransferId
    consumer_session: Annotated[str, msgspec.Meta(min_length=3, max_length=300)]
    layout: Annotated[list[TensorLayout], msgspec.Meta(max_length=65536)]
    dst_block_ids: list[NonNegInt]
    dst_state_slot: Annotated[int, msgspec.Meta(ge=-1)]
    budget_s: Annotated[float, msgspec.Meta(gt=0, le=86400)]
    dst_packed: HostRegion | None = None


class Done(msgspec.Struct, tag="done", tag_field="type", frozen=True, forbid_unknown_fields=True):
    """Consumer -> producer: the consumer is finished with this transfer; free the hold."""

    transfer_id: TransferId


class Reply(msgspec.Struct, tag="reply", tag_field="type", frozen=True, forbid_unknown_fields=True):
    transfer_id: str
    ok: bool
    error: str = ""


ClientMessage = Union[Pull, Done]
Handler = Callable[[ClientMessage], Awaitable[Reply]]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ClientMessage)
_reply_decoder = msgspec.msgpack.Decoder(Reply)


class FrameError(Exception):
    """The peer sent something that is not a well-formed, schema-valid frame."""


def encode_frame(msg: Pull | Done | Reply) -> bytes:
    body = _encoder.encode(msg)
    return len(body).to_bytes(4, "big") + body


async def read_frame(reader: asyncio.StreamReader, timeout: float | None) -> bytes | None:
    """One frame's body; None on a clean EOF before a frame starts. ``timeout`` bounds each read."""
    try:
        header = await asyncio.wait_for(reader.readexactly(4), timeout)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("connection closed inside a frame header") from None
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        return await asyncio.wait_for(reader.readexactly(size), timeout)
    except asyncio.IncompleteReadError:
        raise FrameError(f"connection closed inside a {size}-byte frame") from None


def decode_request(body: bytes) -> ClientMessage:
    try:
        return _request_decoder.decode(body)
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise FrameError(f"invalid message: {e}") from None


def decode_reply(body: bytes) -> Reply:
    try:
        return _reply_decoder.decode(body)
    except msgspec.DecodeError as e:
        raise FrameError(f"invalid reply: {e}") from None


def bind_listener(host: str, port: int) -> socket.socket:
    """Bind and listen now, so the port is ours before anyone is told about it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise RuntimeError(f"P/D side channel cannot listen on {host}:{port}: {e}") from e
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"P/D side channel cannot bind {host}:{port}: {e.strerror or e}; choose a free "
            f"handshake_port in --kv-transfer-config, or 0 to let the kernel pick one"
        ) from e
    return sock


class SideChannelServer:
    """Serves Pull/Done on an already bound socket; ``handler`` answers each one."""

    def __init__(self, sock: socket.socket, handler: Handler) -> None:
        self._sock = sock
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        peer = writer.get_extra_info("peername")
        try:
            while True:
                try:
                    body = await read_frame(reader, IDLE_TIMEOUT_S)
                    if body is None:
                        return
                    msg = decode_request(body)
                except (FrameError, asyncio.TimeoutError) as e:
                    error = str(e) or "timed out waiting for a frame"
                    logger.warning("P/D side channel: rejected a message from %s: %s", peer, error)
                    await _try_send(writer, Reply(transfer_id="", ok=False, error=error))
                    return
                reply = await self._handler(msg)
                if not await _try_send(writer, reply) or not reply.ok:
                    return  # an error ends the conversation
        except OSError as e:
            logger.warning("P/D side channel: connection from %s failed: %s", peer, e)
        except Exception:  # a bug in a handler must not take the server down
            logger.exception("P/D side channel: error serving %s", peer)
        finally:
            self._connections.discard(task)
            writer.close()


async def _try_send(writer: asyncio.StreamWriter, msg: Reply) -> bool:
    try:
        writer.write(encode_frame(msg))
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        return True
    except (OSError, asyncio.TimeoutError):
        return False


class SideChannelClient:
    """One consumer connection to a producer. Callers bound each call (``asyncio.wait_for``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    @classmethod
    async def connect(cls, host: str, port: int) -> "SideChannelClient":
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def call(self, msg: Pull | Done) -> Reply:
        """Send one message and wait for its Reply (FrameError if the producer hangs up)."""
        self._writer.write(encode_frame(msg))
        await self._writer.drain()
        body = await read_frame(self._reader, None)
        if body is None:
            raise FrameError("the producer closed the connection without replying")
        return decode_reply(body)

    async def close(self) -> None:
        self._writer.close()
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except (OSError, asyncio.TimeoutError):
            pass
