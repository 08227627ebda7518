"""gRPC transport: one client-streaming `KVTransfer.Push` call per transfer.

For when NCCL/gloo cannot reach (across clusters, through firewalls). The stream carries the
same headers as every transport; each header is followed by its payload in data chunks of
1 MiB (the last one shorter; a chunk may span the frame's regions). The receiver writes
chunks straight into the validated destination pages as they arrive; a stream that ends
mid-frame, overflows a frame, or breaks off fails the transfer and releases its blocks.

Data chunks are encoded and decoded by hand (`encode_data_chunk`, `decode_chunk`): the bytes on
the wire are exactly a serialized `KVChunk{data}`, but the sender builds them with one copy
out of the pages and the receiver writes a zero-copy view of the received message into the
destination pages, where the generated classes would copy each MiB twice more per side.
Header chunks go through the generated classes.

With a shared secret (kv_transfer/auth.py) the call's metadata carries the transfer id, the
sender's id and an HMAC over both; the servicer checks it before reading a single chunk
(UNAUTHENTICATED otherwise) and then accepts frames of that transfer only. It answers with
its own proof in the trailing metadata, which a sender holding the secret requires.

Connection hygiene: the endpoint serves at most `max_streams` Push streams at once (one
thread each); one more is refused at once with RESOURCE_EXHAUSTED instead of waiting behind
the others. A stream that sends nothing for `idle_timeout_s` (the transfer timeout; a
sender's own deadline is as long, for the whole call) is cancelled and its transfer failed,
freeing its blocks (grpc_idle.py). A connection still in its handshake after that is closed.
"""

from __future__ import annotations

import logging
import queue
import threading
import warnings
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import numpy as np
import torch

from kv_transfer import auth
from kv_transfer.config import DEFAULT_MAX_PUSH_STREAMS, TransferConfig
from kv_transfer.receiver import KVReceiver, Reservation, ack_of
from kv_transfer.transports.base import DEFAULT_TIMEOUT_S as IDLE_S
from kv_transfer.transports.base import Endpoint, SendChannel, Transport, register
from kv_transfer.transports.grpc_idle import IdleWatch
from kv_transfer.wire import TransferError, TransferRejected, TransferUnauthenticated, as_bytes
from protos.pdserve.v1 import kv_transfer_pb2 as pb

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 20
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
_SKIP_LIMIT_BYTES = 1 << 32
# Call metadata keys (lowercase, as gRPC requires).
MD_TRANSFER = "pdserve-kv-transfer-id"
MD_SENDER = "pdserve-kv-sender"
MD_PROOF = "pdserve-kv-proof"

log = logging.getLogger(__name__)

PUSH_METHOD = "/pdserve.v1.KVTransfer/Push"
_DATA_TAG = 0x12  # KVChunk.data: field 2, wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_data_chunk(*parts: memoryview) -> bytes:
    """A serialized `KVChunk(data=b"".join(parts))`, with one copy of the payload."""
    n = sum(len(p) for p in parts)
    return b"".join((bytes((_DATA_TAG,)), _varint(n), *parts))


def decode_chunk(raw: bytes) -> pb.KVChunk | memoryview:
    """A received KVChunk: a data chunk as a zero-copy view of its bytes; anything else
    (headers, or an encoding this fast path does not expect) through the generated class."""
    if raw[:1] == bytes((_DATA_TAG,)):
        n, shift, i = 0, 0, 1
        while i < len(raw) and i <= 10:
            b = raw[i]
            n |= (b & 0x7F) << shift
            shift += 7
            i += 1
            if not b & 0x80:
                if i + n == len(raw):
                    return memoryview(raw)[i:]
                break
    return pb.KVChunk.FromString(raw)


class _FrameWriter:
    """Copies a frame's incoming bytes into its destination regions, in wire order."""

    def __init__(
        self, res: Reservation, header: pb.KVFrameHeader, regions: list[torch.Tensor]
    ) -> None:
        self.res = res
        self.header = header
        self.regions = [as_bytes(r) for r in regions]
        self.cpu = all(r.device.type == "cpu" for r in regions)
        self.views = [r.numpy() for r in self.regions] if self.cpu else []
        self.idx = 0
        self.off = 0
        self.remaining = int(header.payload_bytes)

    def write(self, data: bytes | memoryview) -> None:
        if len(data) > self.remaining:
            raise TransferRejected(
                f"frame overflows its payload_bytes by {len(data) - self.remaining}"
            )
        mv = memoryview(data)
        while mv:
            size = self.regions[self.idx].numel()
            n = min(len(mv), size - self.off)
            if self.cpu:
                self.views[self.idx][self.off : self.off + n] = np.frombuffer(mv[:n], np.uint8)
            else:  # pragma: no cover - CUDA caches
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    src = torch.frombuffer(mv[:n], dtype=torch.uint8)
                self.regions[self.idx][self.off : self.off + n].copy_(src)
            mv = mv[n:]
            self.off += n
            self.remaining -= n
            if self.off == size:
                self.idx += 1
                self.off = 0

    @property
    def done(self) -> bool:
        return self.remaining == 0


class _PushStream:
    """What the receiver knows of one Push stream while it consumes it.

    At most one frame is in flight: either `writer` is filling a validated frame's pages, or
    `skip` counts the payload bytes of a rejected frame still to be discarded; never both.
    `transfer_id` is the transfer the stream carries (the authenticated one, else the last
    header's) and `ack` the answer so far (None until a frame was answered).
    """

    def __init__(self, receiver: KVReceiver, only_transfer_id: str | None) -> None:
        self.receiver = receiver
        self.only_transfer_id = only_transfer_id
        self.transfer_id = only_transfer_id or ""
        self.writer: _FrameWriter | None = None
        self.skip = 0
        self.ack: pb.TransferAck | None = None

    def rejected(self, error: str) -> pb.TransferAck:
        """A REJECTED ack for the current transfer, keeping an earlier rejection's reason
        (the first rejection is the one reported)."""
        ack = self.ack
        if (
            ack is not None
            and ack.status == pb.TRANSFER_STATUS_REJECTED
            and ack.transfer_id == self.transfer_id
        ):
            return ack
        return pb.TransferAck(
            transfer_id=self.transfer_id, status=pb.TRANSFER_STATUS_REJECTED, error=error
        )

    def open_frame(self, h: pb.KVFrameHeader) -> pb.TransferAck | None:
        """Start the frame `h` announces; an ack to end the stream with at once, else None.

        Must hold (else TransferRejected, a framing violation): the previous frame's payload
        is complete, and `h` names the transfer the call authenticated for, if any. An abort
        fails the transfer here. A frame the receiver rejects is answered REJECTED and its
        payload skipped, so the stream stays in step; one too large to skip ends the stream.
        """
        if self.writer is not None or self.skip:
            raise TransferRejected(
                "a header arrived before the previous frame's payload was complete"
            )
        if self.only_transfer_id is not None and h.transfer_id != self.only_transfer_id:
            raise TransferRejected(
                f"frame of transfer {h.transfer_id!r} on a stream authenticated "
                f"for {self.only_transfer_id!r}"
            )
        self.transfer_id = h.transfer_id
        if h.abort:
            error = f"aborted by sender: {h.abort_reason}"
            self.receiver.fail(h.transfer_id, error)
            self.ack = pb.TransferAck(
                transfer_id=h.transfer_id, status=pb.TRANSFER_STATUS_ABORTED, error=error
            )
            return None
        try:
            res, regions = self.receiver.begin_frame(h)
        except TransferRejected as e:
            self.ack = self.rejected(str(e))
            self.skip = int(h.payload_bytes)
            return self.ack if self.skip > _SKIP_LIMIT_BYTES else None
        self.writer = _FrameWriter(res, h, regions)
        if self.writer.done:  # pragma: no cover - empty frames are rejected upstream
            self.receiver.end_frame(res, h)
            self.writer = None
        return None

    def land(self, data: bytes | memoryview) -> None:
        """Write a data chunk into the open frame's pages, or discard it while skipping a
        rejected frame. A chunk with neither is a framing violation (TransferRejected).
        A frame that completes is ended and its ack taken before the engine may take the
        blocks."""
        writer = self.writer
        if writer is not None:
            writer.write(data)
            if writer.done:
                self.receiver.end_frame(writer.res, writer.header)
                self.ack = ack_of(writer.res)
                self.writer = None
        elif self.skip:
            self.skip = max(0, self.skip - len(data))
        else:
            raise TransferRejected("data chunk without a frame header")

    def break_off(self, error: str) -> None:
        """The stream failed: end the open frame (if any) and fail the transfer, so its
        blocks are released now rather than left to the lease."""
        if self.writer is not None:
            self.receiver.end_frame(self.writer.res, self.writer.header, error=error)
        self.receiver.fail(self.transfer_id, error)

    def finish(self) -> pb.TransferAck:
        """The stream ended cleanly: its answer. A frame still open was truncated; frames
        that landed without completing the transfer fail it (one stream is one transfer,
        so nothing more can arrive for it)."""
        tid = self.transfer_id
        if self.writer is not None:
            self.receiver.end_frame(
                self.writer.res, self.writer.header, error="stream ended mid-frame"
            )
            return pb.TransferAck(
                transfer_id=tid,
                status=pb.TRANSFER_STATUS_REJECTED,
                error="stream ended mid-frame (truncated)",
            )
        ack = self.ack
        if ack is None:
            return self.receiver.ack(tid)
        if ack.status == pb.TRANSFER_STATUS_UNSPECIFIED:  # frames landed, but not all of them
            error = "stream ended before every layer arrived"
            self.receiver.fail(tid, error)
            return pb.TransferAck(
                transfer_id=tid,
                status=pb.TRANSFER_STATUS_ABORTED,
                error=error,
                bytes_received=ack.bytes_received,
            )
        return ack


def consume_stream(
    receiver: KVReceiver,
    chunks: Iterator[pb.KVChunk | memoryview],
    only_transfer_id: str | None = None,
) -> pb.TransferAck:
    """Land every frame of one Push stream; the servicer's whole job, testable without gRPC.

    One stream carries one transfer, so a stream that breaks off, ends before every layer
    landed, or violates the framing anywhere (even after the last frame) fails its transfer:
    the blocks are released rather than left to the lease. The first rejection's reason is
    the one reported. `only_transfer_id`: the transfer the call authenticated for; a header
    naming any other is a framing violation.
    """
    stream = _PushStream(receiver, only_transfer_id)
    try:
        for chunk in chunks:
            if isinstance(chunk, memoryview):
                stream.land(chunk)
            elif chunk.HasField("data"):
                stream.land(chunk.data)
            elif chunk.HasField("header"):
                ack = stream.open_frame(chunk.header)
                if ack is not None:  # a rejected frame too large to skip
                    return ack
    except TransferRejected as e:
        stream.break_off(str(e))
        return stream.rejected(str(e))
    except Exception as e:
        error = f"stream broke off: {e}"
        stream.break_off(error)
        return pb.TransferAck(
            transfer_id=stream.transfer_id, status=pb.TRANSFER_STATUS_ABORTED, error=error
        )
    return stream.finish()


class _Servicer:
    def __init__(self, receiver: KVReceiver, secret: str | None, idle_s: float = IDLE_S) -> None:
        self.receiver = receiver
        self.secret = secret
        self.num_refused = 0  # calls refused for failing authentication
        self.idle = IdleWatch(idle_s)

    def Push(
        self, request_iterator: Iterator[pb.KVChunk | memoryview], context: grpc.ServicerContext
    ) -> pb.TransferAck:
        only = None if self.secret is None else self._authenticate(self.secret, context)
        with self.idle.watch(context) as stream:  # cancelled when idle: fails its transfer
            return consume_stream(self.receiver, stream.chunks(request_iterator), only)

    def _authenticate(self, secret: str, context: grpc.ServicerContext) -> str:
        """The transfer id the call proved it may carry; aborts it (UNAUTHENTICATED) if not."""
        md = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        transfer_id, sender = md.get(MD_TRANSFER, ""), md.get(MD_SENDER, "")
        if not auth.verify(secret, md.get(MD_PROOF, ""), "grpc/sender", transfer_id, sender):
            self.num_refused += 1
            log.warning(
                "kv push from %r (%s) refused: authentication failed", sender, context.peer()
            )
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "kv transfer authentication failed (no or wrong shared secret)",
            )
        context.set_trailing_metadata(
            ((MD_PROOF, auth.proof(secret, "grpc/receiver", transfer_id, sender)),)
        )
        return transfer_id


class GrpcEndpoint(Endpoint):
    def __init__(
        self,
        receiver: KVReceiver,
        host: str,
        secret: str | None = None,
        max_streams: int = DEFAULT_MAX_PUSH_STREAMS,
        idle_timeout_s: float = IDLE_S,
    ) -> None:
        self.max_streams = max_streams
        # One thread per stream, and no stream waiting for a thread: one more than
        # `max_streams` is refused (RESOURCE_EXHAUSTED) by gRPC before it reaches us.
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_streams, thread_name_prefix="kv-grpc"),
            options=[
                *GRPC_OPTIONS,
                ("grpc.server_handshake_timeout_ms", int(idle_timeout_s * 1000)),
            ],
            maximum_concurrent_rpcs=max_streams,
        )
        self.servicer = _Servicer(receiver, secret, idle_timeout_s)
        # The generated service, with `decode_chunk` as its request deserializer.
        push = grpc.stream_unary_rpc_method_handler(
            self.servicer.Push,
            request_deserializer=decode_chunk,
            response_serializer=pb.TransferAck.SerializeToString,
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("pdserve.v1.KVTransfer", {"Push": push}),)
        )
        port = self.server.add_insecure_port(f"{host}:0")
        self.server.start()
        self.address = f"{host}:{port}"

    def close(self) -> None:
        self.servicer.idle.close()
        self.server.stop(grace=None)


def frame_chunks(header: pb.KVFrameHeader, regions: Sequence[torch.Tensor]) -> Iterator[bytes]:
    """Serialized KVChunks: the header, then the regions' bytes back to back in data chunks
    of CHUNK_BYTES (the last one shorter). A chunk may span regions (the receiver's writer
    walks them in the same order), so small pages do not mean small messages."""
    yield pb.KVChunk(header=header).SerializeToString()
    parts: list[memoryview] = []
    size = 0
    for region in regions:
        flat = as_bytes(region.cpu() if region.device.type != "cpu" else region).numpy()
        view = memoryview(flat.data)
        while view:
            take = view[: CHUNK_BYTES - size]
            parts.append(take)
            size += len(take)
            view = view[len(take) :]
            if size == CHUNK_BYTES:
                yield encode_data_chunk(*parts)
                parts, size = [], 0
    if parts:
        yield encode_data_chunk(*parts)


class _Call:
    """One in-flight Push: frames are queued as layers finish and streamed by gRPC's thread."""

    def __init__(
        self,
        push: grpc.StreamUnaryMultiCallable,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        self.frames: queue.Queue[tuple[pb.KVFrameHeader, Sequence[torch.Tensor]] | None] = (
            queue.Queue()
        )
        self.future = push.future(self._chunks(), timeout=timeout_s, metadata=metadata)

    def _chunks(self) -> Iterator[bytes]:
        while (item := self.frames.get()) is not None:
            yield from frame_chunks(*item)


class GrpcChannel(SendChannel):
    def __init__(
        self, address: str, timeout_s: float, sender_id: str = "", secret: str | None = None
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.sender_id = sender_id
        self._secret = secret
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        # KVTransfer.Push taking already-serialized KVChunks (`frame_chunks`).
        self.push = self.channel.stream_unary(
            PUSH_METHOD, response_deserializer=pb.TransferAck.FromString
        )
        self._calls: dict[str, _Call] = {}
        self._lock = threading.Lock()

    def _call(self, transfer_id: str) -> _Call:
        with self._lock:
            if transfer_id not in self._calls:
                self._calls[transfer_id] = _Call(
                    self.push, self.timeout_s, self._metadata(transfer_id)
                )
            return self._calls[transfer_id]

    def _metadata(self, transfer_id: str) -> tuple[tuple[str, str], ...]:
        if self._secret is None:
            return ()
        answer = auth.proof(self._secret, "grpc/sender", transfer_id, self.sender_id)
        return ((MD_TRANSFER, transfer_id), (MD_SENDER, self.sender_id), (MD_PROOF, answer))

    def _check_receiver(self, transfer_id: str, call: _Call) -> None:
        """With a secret, the acknowledgement must come from a receiver that holds it too."""
        if self._secret is None:
            return
        trailing = {k: v for k, v in call.future.trailing_metadata() or () if isinstance(v, str)}
        presented = trailing.get(MD_PROOF, "")
        if not auth.verify(self._secret, presented, "grpc/receiver", transfer_id, self.sender_id):
            raise TransferUnauthenticated(
                f"transfer {transfer_id}: {self.address} failed authentication "
                "(it has no or a different shared secret)"
            )

    def send_frame(self, header: pb.KVFrameHeader, regions: Sequence[torch.Tensor]) -> None:
        self._call(header.transfer_id).frames.put((header, regions))

    def finish(self, transfer_id: str, timeout_s: float) -> pb.TransferAck:
        with self._lock:
            call = self._calls.pop(transfer_id, None)
        if call is None:
            raise TransferError(f"transfer {transfer_id}: nothing was sent")
        call.frames.put(None)
        try:
            ack: pb.TransferAck = call.future.result(timeout=timeout_s)
        except (grpc.RpcError, grpc.FutureTimeoutError) as e:
            call.future.cancel()
            # One call failing is one transfer failing; an unreachable server is the channel.
            code = e.code() if isinstance(e, grpc.RpcError) else None
            self.broken = code == grpc.StatusCode.UNAVAILABLE
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise TransferUnauthenticated(
                    f"transfer {transfer_id}: {self.address} refused the push: "
                    f"authentication failed (no or wrong shared secret)"
                ) from e
            raise TransferError(
                f"transfer {transfer_id}: push to {self.address} failed: {e}"
            ) from e
        self._check_receiver(transfer_id, call)
        if ack.status == pb.TRANSFER_STATUS_REJECTED:
            raise TransferRejected(f"transfer {transfer_id}: {ack.error}")
        if ack.status != pb.TRANSFER_STATUS_COMPLETE:
            raise TransferError(f"transfer {transfer_id}: {ack.error or 'not complete'}")
        return ack

    def abort(self, header: pb.KVFrameHeader) -> None:
        call = self._call(header.transfer_id)
        call.frames.put((header, ()))
        call.frames.put(None)
        with self._lock:
            self._calls.pop(header.transfer_id, None)

    def close(self) -> None:
        self.channel.close()


@register
class GrpcTransport(Transport):
    name = "grpc"
    # Concurrent Push streams per endpoint (TransferConfig.max_push_streams); the idle
    # limit per stream is the transport's timeout_s.
    max_push_streams: int = DEFAULT_MAX_PUSH_STREAMS

    def configure(self, cfg: TransferConfig) -> None:
        self.max_push_streams = cfg.max_push_streams

    def listen(self, receiver: KVReceiver, host: str = "127.0.0.1") -> Endpoint:
        return GrpcEndpoint(receiver, host, self.secret, self.max_push_streams, self.timeout_s)

    def connect(self, address: str, sender_id: str) -> SendChannel:
        return GrpcChannel(address, self.timeout_s, sender_id, self.secret)
