from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

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
    __slots__ = ("model_fingerprint", "dtype", "num_layers", "block_size", "num_kv_heads", "head_dim", "wire_version")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    dtype: KVDType
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    wire_version: int
    def __init__(self, model_fingerprint: _Optional[str] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., wire_version: _Optional[int] = ...) -> None: ...

class TransferTicket(_message.Message):
    __slots__ = ("request_id", "transfer_id", "dst_block_ids", "transport", "channel_address", "deadline_unix_ms", "layout", "num_tokens", "first_block", "grammar_fingerprint")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport: str
    channel_address: str
    deadline_unix_ms: int
    layout: KVCacheLayout
    num_tokens: int
    first_block: int
    grammar_fingerprint: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., transport: _Optional[str] = ..., channel_address: _Optional[str] = ..., deadline_unix_ms: _Optional[int] = ..., layout: _Optional[_Union[KVCacheLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., first_block: _Optional[int] = ..., grammar_fingerprint: _Optional[str] = ...) -> None: ...

class KVFrameHeader(_message.Message):
    __slots__ = ("request_id", "transfer_id", "layout", "layer_start", "layer_end", "src_block_ids", "dst_block_ids", "payload_bytes", "abort", "abort_reason", "sender_id")
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
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., layout: _Optional[_Union[KVCacheLayout, _Mapping]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., payload_bytes: _Optional[int] = ..., abort: _Optional[bool] = ..., abort_reason: _Optional[str] = ..., sender_id: _Optional[str] = ...) -> None: ...

class TransferAck(_message.Message):
    __slots__ = ("transfer_id", "status", "error", "bytes_received")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    status: TransferStatus
    error: str
    bytes_received: int
    def __init__(self, transfer_id: _Optional[str] = ..., status: _Optional[_Union[TransferStatus, str]] = ..., error: _Optional[str] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVFrameHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KVFrameHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
