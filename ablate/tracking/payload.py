"""A compact copy of a sealed receipt kept in its run's tags, so one paginated ``search_runs`` returns every
receipt of an experiment instead of one artifact download per run.

Why tags: ``search_runs`` already returns every tag of every run it pages through (the reader needs the run's
``ablate.*`` tags anyway), whereas artifacts cost one request (a file copy for a local store, an HTTP round trip
for a tracking server) per run. Measured on 10,000 receipts: benchmarks/results/promote_store.json.

Layout: ``ablate.payload.n`` = number of chunks, ``ablate.payload.0`` ... ``ablate.payload.<n-1>`` = the base64 of
the zlib-compressed canonical JSON of the sealed receipt, cut into ``CHUNK_CHARS`` pieces. The chunk size stays
under the 5,000-character tag limit of older MLflow servers (3.x allows 8,000), so a client never writes a tag
its server refuses. A receipt whose payload would need more than ``MAX_CHUNKS`` tags gets none: the reader then
downloads its ``receipt.json``, which stays the authoritative copy either way.

Reading never trusts the payload more than the artifact: it is decompressed with a size cap, parsed, validated
by ``validate_receipt`` and checked against the digest it carries and the run's ``ablate.digest`` and
``ablate.receipt_id`` tags; any failure is reported like a damaged ``receipt.json``.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from typing import Mapping, Optional

from ablate.receipts.schema import InvalidReceipt, Receipt
from ablate.receipts.store import seal

PAYLOAD_TAG = "ablate.payload."
COUNT_TAG = PAYLOAD_TAG + "n"
CHUNK_CHARS = 5000
MAX_CHUNKS = 40
"""200,000 base64 characters (~150 KB compressed): far above a real receipt (~5 KB for 25 steps); beyond it
the run carries no payload rather than a run with hundreds of tags."""
MAX_JSON_BYTES = 32 << 20
"""Decompression cap: a forged payload cannot make the reader inflate a zip bomb."""
WHERE = "receipt payload in the run's ablate.payload.* tags"


class PayloadError(ValueError):
    """The run's payload tags are present but unusable (truncated, not base64, not zlib, over the cap)."""


def payload_tags(receipt: Receipt) -> dict[str, str]:
    """The payload tags of a receipt (sealed first, as ``receipt.json`` is); empty when it would not fit."""
    return sealed_payload_tags(seal(receipt))


def sealed_payload_tags(sealed: Receipt) -> dict[str, str]:
    """``payload_tags`` of a receipt already sealed (``store.seal``): a writer that also writes its ``receipt.json``
    seals it once for both."""
    return encode_json(sealed.model_dump_json().encode("utf-8"))


def encode_json(data: bytes) -> dict[str, str]:
    """Payload tags carrying ``data`` (JSON bytes); empty when they would need more than ``MAX_CHUNKS`` tags."""
    encoded = base64.b64encode(zlib.compress(data, 6)).decode("ascii")
    chunks = [encoded[i:i + CHUNK_CHARS] for i in range(0, len(encoded), CHUNK_CHARS)]
    if len(chunks) > MAX_CHUNKS:
        return {}
    tags = {f"{PAYLOAD_TAG}{i}": chunk for i, chunk in enumerate(chunks)}
    tags[COUNT_TAG] = str(len(chunks))
    return tags


def has_payload(tags: Mapping[str, str]) -> bool:
    """Whether the run was logged with a payload (``payload_json`` then returns its bytes or says why it cannot)."""
    return COUNT_TAG in tags


def payload_json(tags: Mapping[str, str]) -> Optional[bytes]:
    """The receipt JSON bytes carried by a run's tags, None when the run has no payload (logged before it
    existed, or too large); ``PayloadError`` when the tags are there but damaged."""
    if not has_payload(tags):
        return None
    count = tags[COUNT_TAG]
    if not (count.isascii() and count.isdigit()) or not 0 < int(count) <= MAX_CHUNKS:
        raise PayloadError(f"{COUNT_TAG} = {count[:20]!r}: not a chunk count in 1..{MAX_CHUNKS}")
    try:
        encoded = "".join(tags[f"{PAYLOAD_TAG}{i}"] for i in range(int(count)))
    except KeyError as exc:
        raise PayloadError(f"{exc.args[0]} is missing ({count} chunks announced)") from None
    try:
        compressed = base64.b64decode(encoded, validate=True)
        inflater = zlib.decompressobj()
        data = inflater.decompress(compressed, MAX_JSON_BYTES)
    except (binascii.Error, ValueError, zlib.error) as exc:
        raise PayloadError(f"not base64 zlib data ({exc})") from None
    if inflater.unconsumed_tail or not inflater.eof:
        raise PayloadError(f"truncated, or larger than {MAX_JSON_BYTES} bytes once decompressed")
    return data


def check_against_run(receipt: Receipt, tags: Mapping[str, str]) -> None:
    """The payload must be the receipt this run was logged for: same id, and (when the run has one) the same
    digest as the run's ``ablate.digest`` tag written from the artifact's content."""
    run_id = tags.get("ablate.receipt_id")
    if run_id is not None and run_id != receipt.identity.receipt_id:
        raise InvalidReceipt(f"receipt id {receipt.identity.receipt_id} does not match the run's ablate.receipt_id "
                             f"{run_id}")
    if receipt.digest is None:
        raise InvalidReceipt("the payload carries no digest (every payload is written sealed)")
    logged = tags.get("ablate.digest")
    if logged is not None and logged != receipt.digest:
        raise InvalidReceipt(f"digest {receipt.digest[:16]} does not match the run's ablate.digest {logged[:16]}")
