"""The router's end of the token stream (`pool_api.token_stream`): a TCP listener that decode
workers push frames to, each delta handed to its request's `PushedStream`.

Runs on the router's event loop. A connection must open with the hello carrying this
listener's secret within `HELLO_TIMEOUT_S`, or it is closed unread; deltas for requests the
router no longer relays are dropped. When a worker's connection ends, every stream placed
on that worker is told (`StreamLost`): its relay then asks the worker, over Ray, whether the
request still lives there (`router.flow`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
from collections import deque
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from pool_api.messages import TokenBatch
from pool_api.token_stream import HEADER, MAX_FRAME_BYTES, TokenSink, batch_of
from protos.pdserve.v1 import WIRE_VERSION
from protos.pdserve.v1 import token_stream_pb2 as tspb

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class StreamLost:
    """The connection that carried this stream's tokens ended."""

    worker: str
    reason: str


@dataclass
class PushedStream:
    """What a worker pushed for one request and the relay has not taken yet."""

    worker: str
    items: deque[TokenBatch | StreamLost] = field(default_factory=deque)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: TokenBatch | StreamLost) -> None:
        self.items.append(item)
        self.event.set()

    async def get(self, timeout_s: float) -> TokenBatch | StreamLost | None:
        """The next item; None after `timeout_s` without one (cancellation loses nothing)."""
        if not self.items:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.event.wait(), timeout_s)
        if not self.items:
            return None
        item = self.items.popleft()
        if not self.items:
            self.event.clear()
        return item


class TokenSinkServer:
    def __init__(self, host: str) -> None:
        self.host = host
        self.sink: TokenSink | None = None  # set by start()
        self.streams: dict[str, PushedStream] = {}
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._latest: dict[str, asyncio.StreamWriter] = {}  # worker -> its newest connection
        self.num_frames_total = 0
        self.num_rejected_total = 0  # connections closed at the hello
        self.num_connections_total = 0  # accepted at the hello

    async def start(self) -> TokenSink:
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.sink = TokenSink(f"{self.host}:{port}", secrets.token_bytes(32))
        return self.sink

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._conns):
            w.close()
        for stream in self.streams.values():
            stream.put(StreamLost(stream.worker, "router stopping"))

    def open(self, request_id: str, worker: str) -> PushedStream:
        """Before the request reaches the worker: its first delta may come at once."""
        stream = self.streams[request_id] = PushedStream(worker)
        return stream

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        worker, reason = "", "closed by the worker"
        try:
            first = await asyncio.wait_for(_read_frame(reader), HELLO_TIMEOUT_S)
            assert self.sink is not None
            if not first.HasField("hello") or not hmac.compare_digest(
                first.hello.secret, self.sink.secret
            ):
                self.num_rejected_total += 1
                log.warning("token stream: a connection without this router's secret, closed")
                return
            if first.hello.wire_version != WIRE_VERSION:
                self.num_rejected_total += 1
                log.warning(
                    "token stream from %s refused: pdserve wire version mismatch: worker %d, "
                    "router %d (workers of different versions never pair)",
                    first.hello.worker,
                    first.hello.wire_version,
                    WIRE_VERSION,
                )
                return
            worker = first.hello.worker
            self.num_connections_total += 1
            self._latest[worker] = writer
            while True:
                f = await _read_frame(reader)
                self.num_frames_total += 1
                for d in f.deltas:
                    stream = self.streams.get(d.request_id)
                    if stream is not None:
                        stream.put(batch_of(d))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            reason = f"connection ended: {type(e).__name__}"
        except asyncio.CancelledError:
            # The router's loop is stopping. End the handler instead of re-raising: Python
            # 3.11's start_server callback calls `exception()` on a cancelled handler task
            # and logs a CancelledError traceback for every open connection.
            reason = "the router stopped"
        except (TimeoutError, ValueError) as e:
            self.num_rejected_total += not worker
            reason = f"bad stream: {e or type(e).__name__}"
            log.warning("token stream from %s: %s", worker or "a peer", reason)
        finally:
            self._conns.discard(writer)
            writer.close()
            # only the worker's newest connection speaks for it: an older one ending late
            # (the process it came from was replaced) says nothing of the streams now
            if worker and self._latest.get(worker) is writer:
                del self._latest[worker]
                for stream in self.streams.values():
                    if stream.worker == worker:
                        stream.put(StreamLost(worker, reason))


async def _read_frame(reader: asyncio.StreamReader) -> tspb.TokenStreamFrame:
    (n,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a {n}-byte frame (limit {MAX_FRAME_BYTES})")
    f = tspb.TokenStreamFrame()
    try:
        f.ParseFromString(await reader.readexactly(n))
    except DecodeError as e:
        raise ValueError(f"undecodable frame: {e}") from e
    return f
