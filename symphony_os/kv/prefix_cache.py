"""Automatic prefix reuse, vLLM-style: identical token prefixes share KV pages.

The cache keeps one block per whole page of a token sequence that some process offered, as
nano-vllm's block manager does: a closed, named KV file holding just that page (tokens
[(k - 1) * page_size, k * page_size) for block k), named by a hash chained over the ids of
tokens [0, k * page_size). A lookup walks the chain from the first block and shares each found
page into a new file, so a prefix of P pages costs P pages and P small files, whatever the
number of prompts that share it. The owner is `<tenant>:prefix`, a name no tenant can spell
(':' is not allowed in a tenant name), so a tenant's cache is its own and no guest can open,
list, overwrite or remove it; its pages count against the tenant's `max_kv_pages`, and when
the tenant is at its quota KVFS evicts the tenant's own least recently used blocks first
(kvfs.KVFS._within_quota). Being closed named files, blocks are also evicted by KVFS like any
other under memory pressure: the tenant's least recently used first (kvfs.KVFS._reclaim).

Only the host writes the cache, and only tokens it saw being appended: a guest opens a file
with `open_longest` (the longest cached prefix of the ids it passes, forked), the host records
every token the guest then appends to it, and `offer` caches the whole pages of exactly those
tokens, at positions 0, 1, 2, ... (see syscalls.kv_open_prefix / kv_cache_prefix).
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from ..errors import InvalidArgument
from .kvfs import KVFS, KvSession, refuse_busy

OWNER_SUFFIX = ":prefix"


def cache_owner(tenant: str) -> str:
    return tenant + OWNER_SUFFIX


def page_keys(ids: list[int], page_size: int) -> list[str]:
    """keys[k - 1] names the prefix ids[:k * page_size], for each whole page k."""
    keys, digest = [], b""
    for start in range(0, len(ids) - page_size + 1, page_size):
        block = struct.pack(f"<{page_size}i", *ids[start:start + page_size])
        digest = hashlib.sha256(digest + block).digest()
        keys.append(digest.hex()[:40])
    return keys


@dataclass
class TrackedFile:
    """A file opened by `open_longest`: the token ids it holds, as far as the host saw (the
    ids of every pred queued on it; `offer` refuses a file on which one failed)."""

    ids: list[int] = field(default_factory=list)


class PrefixCache:
    """The per-tenant prefix caches of one KVFS (their state lives in KVFS itself)."""

    def __init__(self, fs: KVFS):
        self.fs = fs

    def open_longest(self, session: KvSession, ids: list[int]) -> tuple[int, TrackedFile]:
        """A new anonymous file in `session` holding the longest cached prefix of `ids`, at
        most len(ids) - 1 tokens (a pred needs one token to feed), whole pages only."""
        fs, page_size = self.fs, self.fs.pool.page_size
        owner = cache_owner(session.tenant)
        with fs.lock:
            handle = session.create()
            try:
                file, now = session.file_of(handle), fs.clock()
                for key in page_keys(ids[:max(len(ids) - 1, 0)], page_size):
                    block = fs.lookup(owner, key)
                    if block is None or block.length != page_size:
                        break
                    fs.copy_range(block, 0, page_size, file)
                    block.last_used = now
            except BaseException:
                session.close(handle)
                raise
            return handle, TrackedFile(list(ids[:file.length]))

    def offer(self, session: KvSession, handle: int, tracked: TrackedFile) -> int:
        """Cache the whole pages of the tracked file; returns how many tokens are cached."""
        fs, page_size = self.fs, self.fs.pool.page_size
        with fs.lock:
            file = session.file_of(handle)
            refuse_busy(file, "caching its prefix")
            if file.failed_preds:  # its tokens left the file again, not `ids`; a later pred's took their place
                raise InvalidArgument("a pred on this file failed: the tokens it holds are not known, so it "
                                      "cannot be cached")
            if file.length != len(tracked.ids) or (file.length and file.runs != [(0, 0)]):
                raise InvalidArgument("only a file opened by kv_open_prefix and appended to at positions "
                                      "0, 1, 2, ... can be cached")
            keys = page_keys(tracked.ids, page_size)
            # Deepest block first, so the ones nearer the start are the more recently used
            # and outlive it under eviction (a block is reachable only through its predecessors).
            for block, key in reversed(list(enumerate(keys))):
                fs.save_copy(file, block * page_size, (block + 1) * page_size, cache_owner(session.tenant), key)
            return len(keys) * page_size
