"""The event contract: Avro schemas, the single-object codec and the columnar EventBatch."""

from profstream.schema.batch import (
    COLUMN_FILL,
    COMMUNICATION,
    COMPUTE,
    DATA,
    DEVICE_COLUMNS,
    HOST,
    KIND_CODES,
    KIND_NAMES,
    MEMCPY,
    MEMSET,
    NO_VALUE,
    SECTIONS,
    EventBatch,
    decode_batch,
    encode_batch,
)
from profstream.schema.codec import (
    CURRENT,
    SCHEMAS,
    DecodeError,
    crc64_avro,
    decode,
    decode_any,
    encode,
)

__all__ = [
    "COLUMN_FILL", "COMMUNICATION", "COMPUTE", "CURRENT", "DATA", "DEVICE_COLUMNS", "HOST", "KIND_CODES", "KIND_NAMES", "MEMCPY",
    "MEMSET", "NO_VALUE", "SCHEMAS", "SECTIONS", "DecodeError", "EventBatch", "crc64_avro",
    "decode", "decode_any", "decode_batch", "encode", "encode_batch",
]
