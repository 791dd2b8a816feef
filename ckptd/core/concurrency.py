"""How many requests are in flight: small files by the store's latency, large ones by bytes.

A large file is sent (and restored) in parts of ``part_size_mib`` (ranges of
``chunk_mib``): bandwidth and memory bound those, and ``destination.concurrency`` of
them in flight fill a link. A small file is one request whose time is the store's
latency, not its bytes: s5cmd keeps 256 such requests in flight, the AWS CLI 10. Each
of ckptd's costs about 0.1-0.2 ms of CPU, so one core sustains roughly 5,000 a second,
and at a store's 5-30 ms per small request (S3) that takes some 25-150 in flight;
loopback SeaweedFS on two cores is saturated by about 16. So files of at most
``SMALL_FILE_MAX`` bytes go ``SMALL_LANES_PER_SLOT`` per slot of concurrency (32 at the
default of 8, at most ``MAX_LANES``), each lane one file at a time, held whole in memory
(at most lanes x ``SMALL_FILE_MAX``: 32 MiB at the default). ``destination.concurrency``
stays the one setting: it scales both. Pure.
"""

from __future__ import annotations

# A file up to this size is one request each way, held whole in memory while sent.
SMALL_FILE_MAX = 1024 * 1024
# The least part size (S3's, and part_size_mib's least): a file up to it is one PUT
# whatever is configured, never a multipart upload.
NEVER_MULTIPART = 5 * 1024 * 1024
# Small-file requests in flight per slot of destination.concurrency.
SMALL_LANES_PER_SLOT = 4
MAX_LANES = 256


def lanes_for(concurrency: int) -> int:
    """Small-file requests in flight for ``concurrency`` (module doc)."""
    return max(1, min(MAX_LANES, concurrency * SMALL_LANES_PER_SLOT))
