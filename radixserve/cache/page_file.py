"""One KV page on disk: a fixed preamble, a JSON header, then the raw K/V bytes.

    magic "RSKVPAGE" | header length u32 | xxh3_64(header) u64 | header (JSON) | payload

The header names the KV digest (model and settings), the page's chained key, the 128-bit digest of its whole prefix
(namespace and every token up to the page's end), the namespace itself (so a per-namespace flush finds its pages
after a restart) and the payload's length and xxh3_64. A reader checks all of them:
a torn, truncated, bit-flipped or foreign file fails one check and is a miss, never wrong KV.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"RSKVPAGE"
_PREAMBLE = struct.Struct("<8sIQ")
MAX_HEADER = 4096


class PageFileError(ValueError):
    """The bytes are not a valid page of the expected identity (the reason says which check failed)."""


@dataclass(frozen=True)
class PageHeader:
    digest: str  # kv_digest of the model and settings that computed it
    key: int  # the page's chained key in the radix tree
    prefix: int  # xxh3_128 of namespace and tokens up to the page's end
    payload_bytes: int
    payload_checksum: int
    namespace: str

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "digest": self.digest,
                "key": self.key,
                "prefix": f"{self.prefix:032x}",
                "payload_bytes": self.payload_bytes,
                "payload_checksum": self.payload_checksum,
                "namespace": self.namespace,
            }
        ).encode()


def encode(digest: str, key: int, prefix: int, payload: bytes | memoryview, namespace: str) -> bytes:
    payload = memoryview(payload).cast("B")  # flat bytes: len() of a shaped view counts its first dimension only
    header = PageHeader(digest, key, prefix, len(payload), xxhash.xxh3_64_intdigest(payload), namespace).to_json()
    return _PREAMBLE.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header)) + header + bytes(payload)


def decode_header(data: bytes) -> tuple[PageHeader, int]:
    """The header and the payload's offset; raises PageFileError on a bad preamble or header."""
    if len(data) < _PREAMBLE.size:
        raise PageFileError("truncated preamble")
    magic, n, checksum = _PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise PageFileError("not a page file (bad magic)")
    if n > MAX_HEADER or len(data) < _PREAMBLE.size + n:
        raise PageFileError("truncated header")
    raw = data[_PREAMBLE.size : _PREAMBLE.size + n]
    if xxhash.xxh3_64_intdigest(raw) != checksum:
        raise PageFileError("header checksum mismatch")
    try:
        h = json.loads(raw)
        header = PageHeader(
            str(h["digest"]),
            int(h["key"]),
            int(h["prefix"], 16),
            int(h["payload_bytes"]),
            int(h["payload_checksum"]),
            str(h["namespace"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PageFileError(f"bad header: {exc}") from exc
    return header, _PREAMBLE.size + n


def decode(data: bytes, digest: str, key: int, prefix: int, payload_bytes: int) -> memoryview:
    """The payload, after checking that the file is whole and is the page asked for."""
    header, off = decode_header(data)
    if header.digest != digest:
        raise PageFileError("foreign page: computed by another model or settings")
    if header.key != key or header.prefix != prefix:
        raise PageFileError("another page's file: key or prefix digest differ")
    if header.payload_bytes != payload_bytes or len(data) != off + payload_bytes:
        raise PageFileError(f"payload is {len(data) - off} bytes, expected {payload_bytes}")
    payload = memoryview(data)[off:]
    if xxhash.xxh3_64_intdigest(payload) != header.payload_checksum:
        raise PageFileError("payload checksum mismatch")
    return payload
