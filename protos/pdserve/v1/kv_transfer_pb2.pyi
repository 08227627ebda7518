from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class KVDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDType]
    KV_DTYPE_FLOAT32: _ClassVar[KVDType]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDType]
    KV_DTYPE_FLOAT16: _ClassVar[KVDType]

class TransferStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATUS_UNSPECIFIED: _ClassVar[TransferStatus]
    TRANSFER_STATUS_COMPLETE: _ClassVar[TransferStatus]
    TRANSFER_STATUS_REJECTED: _ClassVar[TransferStatus]
    TRANSFER_STATUS_ABORTED: _ClassVar[TransferStatus]
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_BFLOAT16: KVDType
KV_DTYPE_FLOAT16: KVDType
TRANSFER_STATUS_UNSPECIFIED: TransferStatus
TRANSFER_STATUS_COMPLETE: TransferStatus
TRANSFER_STATUS_REJECTED: TransferStatus
TRANSFER_STATUS_ABORTED: TransferStatus

class KVCacheLayout(_message.Message):
    __slots__ = ("block_size", "dtype", "head_dim", "model_fingerprint", "num_kv_heads", "num_layers")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: KVDType
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    def __init__(self, model_fingerprint: str | None = ..., dtype: KVDType | str | None = ..., num_layers: int | None = ..., block_size: int | None = ..., num_kv_heads: int | None = ..., head_dim: int | None = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("channel_address", "deadline_unix_ms", "dst_block_ids", "layout", "num_tokens", "request_id", "transfer_id", "transport")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport: str
    channel_address: str
    deadline_unix_ms: int
    layout: KVCacheLayout
    num_tokens: int
    def __init__(self, request_id: str | None = ..., transfer_id: str | None = ..., dst_block_ids: _Iterable[int] | None = ..., transport: str | None = ..., channel_address: str | None = ..., deadline_unix_ms: int | None = ..., layout: KVCacheLayout | _Mapping | None = ..., num_tokens: int | None = ...) -> None: ...

class KVFrameHeader(_message.Message):
    __slots__ = ("abort", "abort_reason", "dst_block_ids", "layer_end", "layer_start", "layout", "payload_bytes", "request_id", "sender_id", "src_block_ids", "transfer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ABORT_REASON_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    layout: KVCacheLayout
    layer_start: int
    layer_end: int
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    payload_bytes: int
    abort: bool
    abort_reason: str
    sender_id: str
    def __init__(self, request_id: str | None = ..., transfer_id: str | None = ..., layout: KVCacheLayout | _Mapping | None = ..., layer_start: int | None = ..., layer_end: int | None = ..., src_block_ids: _Iterable[int] | None = ..., dst_block_ids: _Iterable[int] | None = ..., payload_bytes: int | None = ..., abort: bool | None = ..., abort_reason: str | None = ..., sender_id: str | None = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("bytes_received", "error", "status", "transfer_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    status: TransferStatus
    error: str
    bytes_received: int
    def __init__(self, transfer_id: str | None = ..., status: TransferStatus | str | None = ..., error: str | None = ..., bytes_received: int | None = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("data", "header")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVFrameHeader
    data: bytes
    def __init__(self, header: KVFrameHeader | _Mapping | None = ..., data: bytes | None = ...) -> None: ...
