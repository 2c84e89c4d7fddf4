"""The fetch protocol: one request, one response, then one framed record per block.

    client -> holder   FetchRequest  (version, token, keys)
    holder -> client   FetchResponse (version, status, num_blocks, block_bytes)
    holder -> client   num_blocks x [ RecordHeader (prefixpool/store/record.py, 32 B) | payload ]

The holder pins the longest prefix of `keys` it still holds before it answers,
so `num_blocks` is exact: a shorter answer means the holder no longer had the
rest (stale metadata is normal, not an error). Messages are msgpack (msgspec);
on byte streams each message is preceded by its length as a little-endian u32.
Knows nothing of sockets, UCX or pools.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass

import msgspec

from prefixpool.store.keys import KEY_BYTES, BlockKey
from prefixpool.store.record import HEADER_BYTES, RecordError, RecordHeader
from prefixpool.transfer.errors import ProtocolError, Unauthorized

PROTOCOL_VERSION = 1
MAX_KEYS = 1 << 16
MAX_MESSAGE_BYTES = MAX_KEYS * (KEY_BYTES + 4) + 4096
LENGTH_PREFIX = struct.Struct("<I")

STATUS_OK = "ok"
STATUS_UNAUTHORIZED = "unauthorized"
STATUS_BAD_REQUEST = "bad_request"


@dataclass(frozen=True)
class ServerDeadlines:
    """How long a holder waits on a peer before it closes the connection (and unpins what it held for it).

    accept ─ request_s ─▶ first request complete      a new connection speaks at once, or is closed
    answer sent ─ idle_s ─▶ next request's first byte   a client keeps connections for its next fetch
    first byte ─ request_s ─▶ that request complete    a half frame then silence is closed
    answer: no byte taken for stall_s                 a peer that stops reading gives its pins back
    """

    request_s: float = 5.0
    idle_s: float = 120.0
    stall_s: float = 30.0


class FetchRequest(msgspec.Struct, frozen=True):
    keys: list[bytes]
    token: str = ""
    version: int = PROTOCOL_VERSION


class FetchResponse(msgspec.Struct, frozen=True):
    status: str
    num_blocks: int = 0
    block_bytes: int = 0
    detail: str = ""
    version: int = PROTOCOL_VERSION


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(FetchRequest)
_response_decoder = msgspec.msgpack.Decoder(FetchResponse)


def encode(message: FetchRequest | FetchResponse) -> bytes:
    return _encoder.encode(message)


def framed(message: FetchRequest | FetchResponse) -> bytes:
    """The message with its u32 length prefix, for byte-stream transports."""
    body = encode(message)
    return LENGTH_PREFIX.pack(len(body)) + body


def message_length(prefix: bytes | bytearray | memoryview) -> int:
    (length,) = LENGTH_PREFIX.unpack(prefix)
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {length} bytes exceeds {MAX_MESSAGE_BYTES}")
    return length


def decode_request(body: bytes | bytearray | memoryview) -> FetchRequest:
    try:
        request = _request_decoder.decode(body)
    except msgspec.DecodeError as err:
        raise ProtocolError(f"bad fetch request: {err}") from err
    if request.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {request.version}, expected {PROTOCOL_VERSION}")
    if len(request.keys) > MAX_KEYS or any(len(key) != KEY_BYTES for key in request.keys):
        raise ProtocolError(f"a request holds at most {MAX_KEYS} keys of {KEY_BYTES} bytes")
    return request


def decode_response(body: bytes | bytearray | memoryview) -> FetchResponse:
    """The holder's answer; raises the typed error for any status but ok."""
    try:
        response = _response_decoder.decode(body)
    except msgspec.DecodeError as err:
        raise ProtocolError(f"bad fetch response: {err}") from err
    if response.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {response.version}, expected {PROTOCOL_VERSION}")
    if response.status == STATUS_UNAUTHORIZED:
        raise Unauthorized(f"peer refused the token: {response.detail}")
    if response.status != STATUS_OK:
        raise ProtocolError(f"peer answered {response.status}: {response.detail}")
    return response


def block_header(raw: bytes | bytearray | memoryview) -> RecordHeader:
    """One block's record header off the wire (the format is prefixpool/store/record.py's)."""
    try:
        return RecordHeader.unpack(raw)
    except RecordError as err:
        raise ProtocolError(str(err)) from err


def token_ok(request: FetchRequest, token: str) -> bool:
    """Whether the request presents the server's shared token (constant-time compare)."""
    return not token or hmac.compare_digest(request.token.encode(), token.encode())


def admit(body: bytes | bytearray | memoryview, token: str) -> FetchRequest | FetchResponse:
    """The request to serve, or the refusal to send back before closing the connection."""
    try:
        request = decode_request(body)
    except ProtocolError as err:
        return FetchResponse(STATUS_BAD_REQUEST, detail=str(err))
    if not token_ok(request, token):
        return FetchResponse(STATUS_UNAUTHORIZED, detail="wrong token")
    return request


def request_keys(request: FetchRequest) -> list[BlockKey]:
    return [BlockKey(key) for key in request.keys]


__all__ = ["HEADER_BYTES", "FetchRequest", "FetchResponse", "PROTOCOL_VERSION", "ServerDeadlines"]
