"""KVFS: the file system for KV caches (the paper's KV-cache file system).

A KV file is a list of pool pages plus a length in tokens. Files are reached through handles
(small integers local to one `KvSession`, so a handle means nothing to anyone else). A file
may have a name in its owner's namespace; named files outlive their handles until removed or
evicted, anonymous files die with their last handle.

Positions: every token's KV was computed at a RoPE position. Writes must continue a file without
gaps: a non-empty file takes exactly `next_position, next_position + 1, ...`; an empty file may
start anywhere. Files built by `merge` keep each part's positions (Prompt-Cache-style reuse).

Memory: when the pool runs short, KVFS evicts closed named files (from the tenant holding the
most pages first; within a tenant, lowest priority first, then least recently used; pinned
files and files inside their keep-for window are spared), then swaps pages of open files that
the current batch does not use to host memory (in the same order), and only then refuses with
`PoolExhausted`.

Sharing between tenants: a file's owner may share it read-only with named tenants, who open it
as `@owner/path` with `OpenFlags.READ_ONLY`.

Size: a file holds at most `max_file_tokens` tokens (the model's context), and page quotas count
what attending over a tenant's files costs: each distinct page once (forks share), plus every
further time a file holds the same page (a file merged with itself holds its pages twice: without
this, 18 merges of a file with itself made four million tokens out of one page).
"""
from __future__ import annotations

import contextlib
import enum
import re
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterator

import torch

from ..errors import (BadHandle, FileBusy, FileExists, FileNotFound, InvalidArgument, LimitExceeded, PermissionDenied,
                      PositionError, ReadOnlyFile)
from .pool import HostPage, KVPool

MAX_PATH_BYTES = 255
MAX_POSITION = 2**31 - 1  # positions are 32-bit in the guest ABI and in the kernels
_NO_RUN = (0, 0)  # an empty file's runs: its next position is 0
# Named files a tenant may keep, unless `KVFS.file_quota` says otherwise. An empty named file
# holds no page, so page quotas do not bound them, and each costs the host ~900 bytes: a guest
# creating and closing names in a loop (80k a second) would otherwise fill the host's memory.
DEFAULT_MAX_NAMED_FILES = 65_536
_PATH_COMPONENT = re.compile(r"^[A-Za-z0-9._\-]+$")


def quota_account(owner: str) -> str:
    """The tenant whose page quota a file counts against: a host-side cache of a tenant (owner
    `<tenant>:<cache>`, a name no tenant can spell; prefix_cache.py) counts against the tenant."""
    return owner.partition(":")[0]


class OpenFlags(enum.IntFlag):
    """Flags of `KvSession.open`; the values are part of the guest ABI."""

    NONE = 0
    CREATE = 1
    EXCLUSIVE = 2
    READ_ONLY = 4


@dataclass
class EvictionHints:
    """How the owner wants a file treated under memory pressure.

    pinned: never evicted or swapped by the system.
    keep_for_s: not evicted for this many seconds after its last use; after that it goes first
        among its tenant's files.
    drop_on_close: a named file that is removed when its last handle closes.
    priority: among its tenant's evictable files, lower priority goes first (then least
        recently used). Across tenants, the one holding the most pages gives first.
    """

    pinned: bool = False
    keep_for_s: float | None = None
    drop_on_close: bool = False
    priority: int = 0


@dataclass(frozen=True)
class FileStat:
    """What `stat` and `list` report about one file."""

    name: str | None
    owner: str
    length: int
    pages: int
    swapped_pages: int
    next_position: int
    open_handles: int
    shared_with: tuple[str, ...]
    hints: EvictionHints
    idle_s: float


class KvFile:
    """One KV file (an inode). Only KVFS touches its fields, under its lock."""

    __slots__ = (
        "file_id", "name", "owner", "pages", "length", "runs", "refs", "inflight",
        "hints", "last_used", "shared_with", "host_pages", "readers", "failed_preds", "repeated_pages",
    )

    def __init__(self, file_id: int, owner: str, name: str | None, now: float):
        self.file_id = file_id
        self.name = name
        self.owner = owner
        self.pages: list[int | HostPage] = []
        self.host_pages = 0  # entries of `pages` swapped out to host memory
        self.length = 0
        # Position runs: (first token index, its position); a run continues +1 per token
        # until the next run starts. One run per merge part, so this stays tiny.
        self.runs: list[tuple[int, int]] = []
        self.refs = 0  # open handles + pred requests holding the file
        self.inflight = 0  # pred requests submitted and not yet completed
        self.hints = EvictionHints()
        self.last_used = now
        self.shared_with: frozenset[str] = frozenset()
        self.readers: dict[tuple[KvSession, int], None] | None = None  # other tenants' handles
        self.failed_preds = 0  # preds on it that failed (and were rolled back)
        self.repeated_pages = 0  # entries of `pages` that repeat an earlier one (a merge with itself)

    @property
    def next_position(self) -> int:
        if not self.runs:
            return 0
        index, position = self.runs[-1]
        return position + (self.length - index)

    def position_at(self, i: int) -> int:
        for index, position in reversed(self.runs):
            if index <= i:
                return position + (i - index)
        raise IndexError(i)

    def runs_between(self, start: int, end: int) -> list[tuple[int, int]]:
        """The position runs of tokens [start, end), re-based so that `start` is index 0."""
        runs = [(0, self.position_at(start))] if end > start else []
        runs += [(index - start, pos) for index, pos in self.runs if start < index < end]
        return runs

    @property
    def resident(self) -> bool:
        return self.host_pages == 0


@dataclass(slots=True)
class _Handle:
    file: KvFile
    writable: bool


def refuse_busy(file: KvFile, doing: str) -> None:
    """FileBusy while `file` has a pred in flight: its length changes once the pred is scheduled
    (and back, if it fails), and its newest tokens' KV is written only by the forward pass."""
    if file.inflight:
        raise FileBusy(f"the file has a pred in flight; wait for it before {doing}")


class KVFS:
    """The KV file system over one pool: files, names, eviction and swapping.

    Thread-safe: every operation holds one lock. Processes and tenants use it through
    `session(tenant)`; the batch scheduler uses `reserve_slots` / `page_table` / `protect`.
    """

    def __init__(self, pool: KVPool, clock=time.monotonic, max_file_tokens: int | None = None):
        self.pool = pool
        self.clock = clock
        self.max_file_tokens = max_file_tokens  # None: files are bounded by the pool and quotas alone
        self._token_bound = max_file_tokens if max_file_tokens is not None else MAX_POSITION + 1
        self.lock = threading.RLock()
        self._files: dict[int, KvFile] = {}
        self._names: dict[tuple[str, str], KvFile] = {}
        self._next_file_id = 1
        self._protected: list[set[int]] = []  # the file ids of each protect() block open now
        self.evicted_files = 0
        self.swapped_out_pages = 0
        # Tenant -> most pages its files may hold; checked when a file grows (see pages_of).
        self.page_quota: dict[str, int] = {}
        # Tenant -> most named files it may keep (default DEFAULT_MAX_NAMED_FILES). Host-side
        # caches (owner `<tenant>:<cache>`) are not counted: each of their files holds a page.
        self.file_quota: dict[str, int] = {}
        self._named: Counter[str] = Counter()  # owner -> its named files
        # Account (quota_account) -> page -> references from its files: kept as pages come and
        # go, so a quota check costs no walk over files and forked pages count once.
        self._held: dict[str, dict[int | HostPage, int]] = {}
        self._repeated: Counter[str] = Counter()  # account -> its files' repeated_pages, summed
        pool.reclaim = self._reclaim

    def session(self, tenant: str = "default", max_handles: int = 4096) -> "KvSession":
        """A handle table for one process, naming files in `tenant`'s namespace."""
        return KvSession(self, tenant, max_handles)

    # ---- used by sessions and the scheduler, always under self.lock ----

    def _new_file(self, owner: str, name: str | None = None) -> KvFile:
        if name is not None and ":" not in owner:
            quota = self.file_quota.get(owner, DEFAULT_MAX_NAMED_FILES)
            if self._named[owner] >= quota:
                raise LimitExceeded(f"named KV file quota of tenant {owner!r}: it keeps {self._named[owner]} of "
                                    f"{quota}; remove some (kv_remove) or use anonymous files")
        file = KvFile(self._next_file_id, owner, name, self.clock())
        self._next_file_id += 1
        self._files[file.file_id] = file
        if name is not None:
            self._names[(owner, name)] = file
            self._named[owner] += 1
        return file

    def revoke_readers(self, file: KvFile) -> None:
        """Close other tenants' handles to `file` whose tenant it is no longer shared with
        (or all of them, once its name is removed): a reader's open handle kept the owner's
        pages, charged to the owner's quota, for as long as the reader liked."""
        for session, handle in list(file.readers or ()):
            if file.name is None or not (session.tenant in file.shared_with or "*" in file.shared_with):
                session._revoke(handle)

    def acquire(self, file: KvFile) -> None:
        file.refs += 1
        file.last_used = self.clock()

    def release(self, file: KvFile, now: float | None = None) -> None:
        """Drop one reference; anonymous files (and drop-on-close ones) die with the last.
        `now`: the clock, when the caller read it already (a batch releases many files)."""
        file.refs -= 1
        file.last_used = self.clock() if now is None else now
        if file.refs > 0:
            return
        if file.name is None:
            self._free_file(file)
        elif file.hints.drop_on_close:
            self._unlink(file)
            self._free_file(file)

    def _unlink(self, file: KvFile) -> None:
        if file.name is not None:
            del self._names[(file.owner, file.name)]
            self._named[file.owner] -= 1
            file.name = None

    def _count_pages(self, file: KvFile, added=(), removed=()) -> None:
        """Keep `_held` in step with a change to `file.pages`."""
        held = self._held.setdefault(quota_account(file.owner), {})
        for page in added:
            held[page] = held.get(page, 0) + 1
        for page in removed:
            if held[page] == 1:
                del held[page]
            else:
                held[page] -= 1

    def _recount_repeats(self, file: KvFile) -> None:
        """Keep `file.repeated_pages` and its account's sum in step after `file.pages` changed."""
        repeated = len(file.pages) - len(set(file.pages))
        if repeated != file.repeated_pages:
            self._repeated[quota_account(file.owner)] += repeated - file.repeated_pages
            file.repeated_pages = repeated

    def charged_pages(self, account: str) -> int:
        """What `account`'s files cost against its page quota (see the module docstring)."""
        return len(self._held.get(account, ())) + self._repeated[account]

    def _free_file(self, file: KvFile) -> None:
        self._count_pages(file, removed=file.pages)
        self._drop_pages(file.pages)
        if file.repeated_pages:
            self._repeated[quota_account(file.owner)] -= file.repeated_pages
            file.repeated_pages = 0
        file.pages = []
        file.length = 0
        file.runs = []
        del self._files[file.file_id]

    def _drop_pages(self, pages: list[int | HostPage]) -> None:
        device_pages = [p for p in pages if not isinstance(p, HostPage)]
        self.pool.decref(device_pages)
        for page in pages:
            if isinstance(page, HostPage):
                self.pool.discard(page)

    def _share_pages(self, pages: list[int | HostPage]) -> list[int | HostPage]:
        """References to `pages` for a second file: device pages are shared, host pages copied
        (PoolExhausted, before anything is shared, when the host has no room for the copies)."""
        copies = iter(self.pool.copy_host_pages([p for p in pages if isinstance(p, HostPage)]))
        self.pool.incref([p for p in pages if not isinstance(p, HostPage)])
        return [next(copies) if isinstance(page, HostPage) else page for page in pages]

    def lookup(self, tenant: str, path: str) -> KvFile | None:
        owner, name = _split_path(tenant, path)
        return self._names.get((owner, name))

    def ensure_resident(self, file: KvFile) -> None:
        """Swap the file's host pages back into the pool."""
        if file.resident:
            return
        with self.protect([file]):
            for i, page in enumerate(file.pages):
                if isinstance(page, HostPage):
                    file.pages[i] = self.pool.swap_in(page)
                    file.host_pages -= 1
                    self._count_pages(file, added=[file.pages[i]], removed=[page])

    @contextlib.contextmanager
    def protect(self, files: list[KvFile]) -> Iterator[None]:
        """Within this block, the given files are not swapped out or evicted to make room (the
        lock is taken only to update the protected set, so a forward pass can run inside)."""
        ids = {f.file_id for f in files}
        with self.lock:
            self._protected.append(ids)
        try:
            yield
        finally:
            # Each block keeps its own set: one that ends does not unprotect a file another
            # block still holds (the engine's runs a whole forward pass without the lock).
            # Nothing per file: a batch protects every file it runs.
            with self.lock:
                blocks = self._protected
                del blocks[next(i for i, block in enumerate(blocks) if block is ids)]

    def _protected_ids(self) -> set[int]:
        """The files some protect() block holds now (under the lock)."""
        return set().union(*self._protected)

    def reserve_slots(self, file: KvFile, positions: list[int], now: float | None = None,
                      from_file: bool = False) -> list[int]:
        """Make room for `len(positions)` new tokens at the end of `file` and return their flat
        slot indices (`page * page_size + offset`). Copies a shared, partly filled last page
        first (copy-on-write). The tokens count as part of the file from now on. `now`: the
        clock, when the caller read it already (a batch reserves for many files). `from_file`:
        the caller took the positions from `file.next_position` under this lock just now, so
        they need no checking (a pred that continues its file: most decode steps)."""
        n = len(positions)
        if n == 0:
            raise InvalidArgument("pred needs at least one token")
        first = positions[0]
        if positions[-1] > MAX_POSITION:  # a file continued past the 32-bit positions
            raise PositionError(f"positions end at {MAX_POSITION}; this pred would reach {positions[-1]}")
        if not from_file:
            if file.length > 0:
                expected = file.next_position
                if first != expected:
                    raise PositionError(f"positions must continue the file: expected {expected}, got {first}")
            if n > 1 and positions != list(range(first, first + n)):
                a, b = next((a, b) for a, b in zip(positions, positions[1:]) if b != a + 1)
                raise PositionError(f"positions must increase by one: {a} then {b}")
            if first < 0:
                raise PositionError(f"positions must be non-negative, got {first}")
        slots = self._grow(file, n, now)
        if file.length == n:
            file.runs = [(0, positions[0])]
        return slots

    def reserve_next(self, file: KvFile, now: float) -> tuple[int, int]:
        """One token continuing `file` at its next position (a decode step): (its position, its
        flat slot). The token counts as part of the file from now on. Under the lock; `now` is
        the batch's clock. The common case, the token in the file's own resident last page,
        takes no call (one a sequence a batch); the rest is `reserve_slots`."""
        length, pool = file.length, self.pool
        runs = file.runs
        index, first = runs[-1] if runs else _NO_RUN
        position = first + length - index
        offset = length % pool.page_size
        if offset and 0 <= position < MAX_POSITION and length < self._token_bound and not file.host_pages:
            last = file.pages[-1]
            if pool.refcount[last] == 1:
                file.length = length + 1
                file.last_used = now
                return position, last * pool.page_size + offset
        return position, self.reserve_slots(file, [position], now, position >= 0)[0]

    def reserve_tentative(self, file: KvFile) -> tuple[int, int, int] | None:
        """A decode step the engine runs before anyone asked for it (engine/speculation.py): the
        position and slot `reserve_next` would give the file's next token, in its own resident
        last page, that page pinned (one more reference, so it outlives a truncate meanwhile),
        the file's length unchanged: (position, slot, page), or None outside that common case.
        The step is then adopted (`adopt_tentative`) or dropped; either way the page is unpinned
        once it ran. Under the lock."""
        length, pool = file.length, self.pool
        runs = file.runs
        index, first = runs[-1] if runs else _NO_RUN
        position = first + length - index
        offset = length % pool.page_size
        if not offset or not 0 <= position < MAX_POSITION or length >= self._token_bound or file.host_pages:
            return None
        last = file.pages[-1]
        if pool.refcount[last] != 1:
            return None
        pool.pin(last)
        return position, last * pool.page_size + offset, last

    def adopt_tentative(self, file: KvFile, position: int, length_before: int, page: int, now: float) -> bool:
        """Make the tentative token (`reserve_tentative`) the file's next one, if the file is as
        it was then: its length, its last page (its own but for the pin), the next position.
        Under the lock."""
        if file.length != length_before or file.host_pages or not file.pages or file.pages[-1] != page \
                or self.pool.refcount[page] != 2:
            return False
        runs = file.runs
        index, first = runs[-1] if runs else _NO_RUN
        if first + length_before - index != position:
            return False
        file.length = length_before + 1
        file.last_used = now
        return True

    def _grow(self, file: KvFile, n: int, now: float | None = None) -> list[int]:
        """Add `n` token slots at the end of the file (pages allocated, a shared partly filled
        last page copied first) and return their flat slot indices."""
        if self.max_file_tokens is not None and file.length + n > self.max_file_tokens:
            self._refuse_length(file, n)
        page_size = self.pool.page_size
        offset = file.length % page_size
        if offset and offset + n <= page_size and not file.host_pages and self.pool.refcount[file.pages[-1]] == 1:
            # The tokens fit in the file's own, resident last page (most decode steps).
            first = file.pages[-1] * page_size + offset
            file.length += n
            file.last_used = self.clock() if now is None else now
            return [first] if n == 1 else list(range(first, first + n))
        self.ensure_resident(file)
        copy_last = bool(file.length % page_size) and self.pool.refcount[file.pages[-1]] > 1
        needed = -(-(file.length + n) // page_size) - len(file.pages)
        if needed + copy_last:  # else the tokens fit in the file's own last page
            self._within_quota(file.owner, needed + copy_last)
            # Only an allocation that may reclaim (evict or swap) needs the file protected.
            guard = self.protect([file]) if needed + copy_last > self.pool.free_pages else contextlib.nullcontext()
            with guard:
                if copy_last:
                    old = file.pages[-1]
                    file.pages[-1] = self.pool.copy_page(old)
                    self.pool.decref([old])
                    self._count_pages(file, added=[file.pages[-1]], removed=[old])
                    if file.repeated_pages:  # the old page may have been one of the repeats
                        self._recount_repeats(file)
                new_pages = self.pool.allocate(needed)
                file.pages.extend(new_pages)
                self._count_pages(file, added=new_pages)
        slots: list[int] = []  # a page's run of slots at a time (a prompt's thousands of tokens)
        at, end, pages = file.length, file.length + n, file.pages
        while at < end:
            index, offset = divmod(at, page_size)
            take = min(page_size - offset, end - at)
            first = pages[index] * page_size + offset
            slots.extend(range(first, first + take))
            at += take
        file.length += n
        file.last_used = self.clock() if now is None else now
        return slots

    def pages_of(self, owner: str) -> int:
        """The pages charged to `owner`'s quota account (its own files and its host-side
        caches': quota_account): distinct pages in the pool or swapped out, forked pages once,
        plus the pages a file holds more than once (charged_pages)."""
        with self.lock:
            return self.charged_pages(quota_account(owner))

    def _refuse_length(self, file: KvFile, more: int) -> None:
        """LimitExceeded: `more` tokens would take `file` past `max_file_tokens`."""
        raise LimitExceeded(f"a KV file holds at most {self.max_file_tokens} tokens (the model's context); this "
                            f"one has {file.length}, {more} more asked for")

    def _within_quota(self, owner: str, more: int) -> None:
        """Raise LimitExceeded unless `owner`'s account may be charged `more` pages, evicting
        its host-side cache files (least recently used first) to make room."""
        account = quota_account(owner)
        quota = self.page_quota.get(account)
        if quota is None or more <= 0:
            return
        if self.charged_pages(account) + more > quota:
            self._evict_caches_of(account, self.charged_pages(account) + more - quota)
        charged = self.charged_pages(account)
        if charged + more > quota:
            raise LimitExceeded(f"KV page quota of tenant {account!r}: its files hold {charged} of {quota} "
                                f"pages, {more} more needed; close or remove KV files")

    def _evict_caches_of(self, account: str, pages: int) -> None:
        """Evict the account's closed cache files until `pages` of its pages are freed (or
        none is left). Among equally recent files, those holding later positions go first:
        a prefix cache's deeper blocks are worth less than the ones every lookup passes."""
        now, protected = self.clock(), self._protected_ids()
        target = self.charged_pages(account) - pages
        victims = sorted((f for (owner, _), f in self._names.items()
                          if owner != account and quota_account(owner) == account and self._evictable(f, now)
                          and f.file_id not in protected),
                         key=lambda f: (f.last_used, -f.next_position))
        for file in victims:
            if self.charged_pages(account) <= target:
                return
            self._unlink(file)
            self._free_file(file)
            self.evicted_files += 1

    def save_copy(self, src: KvFile, start: int, end: int, owner: str, name: str) -> bool:
        """Make a closed named file `name` of `owner` holding src's tokens [start, end) (whole
        pages shared) unless one exists; True when it was made. For host-side caches
        (prefix_cache.py): the file is evicted like any closed named file."""
        with self.lock:
            if (owner, name) in self._names:
                self._names[(owner, name)].last_used = self.clock()
                return False
            file = self._new_file(owner, name)
            try:
                self.copy_range(src, start, end, file)
            except BaseException:  # the pool is full, say: no empty block left under that name
                self._unlink(file)
                self._free_file(file)
                raise
            return True

    def copy_range(self, src: KvFile, start: int, end: int, dst: KvFile) -> None:
        """Append src's tokens [start, end) to dst, sharing whole pages where alignment allows.
        FileBusy while src has a pred in flight."""
        refuse_busy(src, "copying from it")
        page_size = self.pool.page_size
        if end <= start:
            return
        if self.max_file_tokens is not None and dst.length + end - start > self.max_file_tokens:
            self._refuse_length(dst, end - start)
        # Protected from the start: making src resident may reclaim, and either may be a closed
        # named file (a host-side cache's), which reclaiming would otherwise evict.
        with self.protect([src, dst]):
            self.ensure_resident(src)
            if start % page_size == 0 and dst.length % page_size == 0:
                first, last = start // page_size, -(-end // page_size)
                if self.page_quota:  # new to the account, or repeated in dst: charged
                    held, in_dst, more = self._held.get(quota_account(dst.owner), {}), set(dst.pages), 0
                    for page in src.pages[first:last]:
                        more += isinstance(page, HostPage) or page not in held or page in in_dst
                        in_dst.add(page)
                    self._within_quota(dst.owner, more)
                shared = self._share_pages(src.pages[first:last])
                dst.pages.extend(shared)
                self._count_pages(dst, added=shared)
                self._recount_repeats(dst)
                dst.host_pages += sum(isinstance(p, HostPage) for p in shared)
                _append_runs(dst, dst.length, src.runs_between(start, end))
                dst.length += end - start
                return
            base = dst.length
            dst_slots = self._grow(dst, end - start)
            _append_runs(dst, base, src.runs_between(start, end))
            src_slots = [
                src.pages[i // page_size] * page_size + i % page_size for i in range(start, end)
            ]
            device = self.pool.device
            self.pool.copy_tokens(
                torch.tensor(src_slots, device=device), torch.tensor(dst_slots, device=device)
            )

    def truncate_file(self, file: KvFile, length: int) -> None:
        if length < 0 or length > file.length:
            raise InvalidArgument(f"truncate to {length}: the file has {file.length} tokens")
        refuse_busy(file, "truncating")
        self.shrink(file, length)

    def end_pred(self, file: KvFile, failed: bool, length_before: int | None, now: float | None = None) -> None:
        """A pred taken with `KvSession.take_for_pred` is over: its in-flight count and its
        reference go (`release`); a failed one's tokens are cut off again, back to the file's
        `length_before` (None: it appended none). Under the lock."""
        if failed:
            file.failed_preds += 1
            if length_before is not None:
                self.shrink(file, length_before)
        file.inflight -= 1
        self.release(file, now)

    def end_preds(self, ended: list[tuple[KvFile, bool, int | None]], now: float) -> None:
        """`end_pred` of each (file, failed, length_before) of a batch, in one call. Under the
        lock."""
        for file, failed, length_before in ended:
            if failed:
                self.end_pred(file, failed, length_before, now)
                continue
            file.inflight -= 1
            refs = file.refs = file.refs - 1  # `release`, inline: its common case
            file.last_used = now
            if refs <= 0:
                file.refs = refs + 1
                self.release(file, now)

    def shrink(self, file: KvFile, length: int) -> None:
        """Cut the file to its first `length` tokens, freeing whole pages past them."""
        keep_pages = -(-length // self.pool.page_size)
        dropped = file.pages[keep_pages:]
        self._count_pages(file, removed=dropped)
        file.host_pages -= sum(isinstance(p, HostPage) for p in dropped)
        self._drop_pages(dropped)
        del file.pages[keep_pages:]
        if file.repeated_pages:
            self._recount_repeats(file)
        file.runs = [(i, p) for i, p in file.runs if i < length]
        file.length = length
        file.last_used = self.clock()

    def _reclaim(self, pages_needed: int) -> None:
        """Free pages: evict closed named files, then swap unprotected open files to host.
        Files are evicted from the tenant (quota account) holding the most pages first, each
        tenant's in the order its hints give (past keep-for, lowest priority, least recently
        used), and swapped likewise: one order across tenants let a tenant's hints shield its
        files from another's pressure, as many as the pool holds."""
        target = self.pool.free_pages + pages_needed
        now = self.clock()
        protected = self._protected_ids()
        evictable = [f for f in self._files.values() if self._evictable(f, now) and f.file_id not in protected]
        for _, file in _largest_first(evictable, lambda f: (f.hints.keep_for_s is None, f.hints.priority, f.last_used),
                                      lambda account: len(self._held.get(account, ()))):
            if self.pool.free_pages >= target:
                return
            self._unlink(file)
            self._free_file(file)
            self.evicted_files += 1
        if self.pool.free_pages >= target:
            return
        # Then pages of open files go to host memory, the same way: from the tenant with the
        # most of their pages in the pool first, each tenant's files in its hints' order.
        swappable = [f for f in self._files.values() if f.refs and not f.hints.pinned and f.file_id not in protected]
        resident: dict[str, int] = {}  # account -> pages of its swappable files in the pool
        for file in swappable:
            account = quota_account(file.owner)
            resident[account] = resident.get(account, 0) + len(file.pages) - file.host_pages
        for account, file in _largest_first(swappable, lambda f: (f.hints.priority, f.last_used), resident.__getitem__):
            for i, page in enumerate(file.pages):
                if self.pool.free_pages >= target or not self.pool.swap_room:
                    return
                if not isinstance(page, HostPage) and self.pool.refcount[page] == 1:
                    file.pages[i] = self.pool.swap_out(page)
                    file.host_pages += 1
                    self._count_pages(file, added=[file.pages[i]], removed=[page])
                    self.swapped_out_pages += 1
                    resident[account] -= 1

    @staticmethod
    def _evictable(file: KvFile, now: float) -> bool:
        """A closed named file that its hints let go (pinned never; keep-for after its window)."""
        if file.refs or file.hints.pinned or file.name is None:
            return False
        return file.hints.keep_for_s is None or now - file.last_used >= file.hints.keep_for_s

    def stat_file(self, file: KvFile) -> FileStat:
        swapped = sum(isinstance(p, HostPage) for p in file.pages)
        return FileStat(
            name=file.name,
            owner=file.owner,
            length=file.length,
            pages=len(file.pages),
            swapped_pages=swapped,
            next_position=file.next_position,
            open_handles=file.refs,
            shared_with=tuple(sorted(file.shared_with)),
            hints=EvictionHints(**vars(file.hints)),
            idle_s=self.clock() - file.last_used,
        )

    def list_files(self, tenant: str, prefix: str = "") -> list[FileStat]:
        """Named files of `tenant` plus files other tenants share with it (as `@owner/name`)."""
        with self.lock:
            out = []
            for (owner, name), file in sorted(self._names.items()):
                visible = owner == tenant or tenant in file.shared_with or "*" in file.shared_with
                shown = name if owner == tenant else f"@{owner}/{name}"
                if visible and shown.startswith(prefix):
                    out.append(self.stat_file(file))
            return out

    @property
    def file_count(self) -> int:
        return len(self._files)


def _largest_first(files: list[KvFile], order, size) -> Iterator[tuple[str, KvFile]]:
    """(quota account, file) pairs: the next file of the account whose `size(account)` is
    largest now, each account's files in `order` (memory reclaim: see KVFS._reclaim)."""
    queues: dict[str, deque[KvFile]] = {}
    for file in sorted(files, key=order):
        queues.setdefault(quota_account(file.owner), deque()).append(file)
    while queues:
        account = max(queues, key=size)
        file = queues[account].popleft()
        if not queues[account]:
            del queues[account]
        yield account, file


def _append_runs(dst: KvFile, base: int, runs: list[tuple[int, int]]) -> None:
    """Add position runs that start at token `base` of dst, merging one that continues dst's
    last run (so a file rebuilt from consecutive blocks keeps a single run)."""
    for index, position in runs:
        if dst.runs and dst.runs[-1][1] + (base + index - dst.runs[-1][0]) == position:
            continue
        dst.runs.append((base + index, position))


def _validate_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgument("a KV file name must be a non-empty string")
    if len(name.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES:
        raise InvalidArgument(f"a KV file name is at most {MAX_PATH_BYTES} bytes")
    for part in name.split("/"):
        if part in ("", ".", "..") or not _PATH_COMPONENT.match(part):
            raise InvalidArgument(
                f"bad KV file name {name[:64]!r}: use '/'-separated parts of letters, digits, '.', '_', '-' "
                "(no empty parts, '.' or '..')"
            )
    return name


def _split_path(tenant: str, path: str) -> tuple[str, str]:
    """`name` is in the caller's namespace; `@owner/name` in another tenant's."""
    if isinstance(path, str) and path.startswith("@"):
        owner, sep, name = path[1:].partition("/")
        if not sep or not owner:
            raise InvalidArgument(f"bad shared path {path[:64]!r}: expected '@owner/name'")
        _validate_name(owner)
        return owner, _validate_name(name)
    return tenant, _validate_name(path)


class KvSession:
    """One process's view of KVFS: its handle table, in one tenant's namespace.

    Handles are small positive integers valid only in this session. `close_all` (at process
    exit) releases everything the session still holds.
    """

    def __init__(self, fs: KVFS, tenant: str, max_handles: int):
        _validate_name(tenant)
        self.fs = fs
        self.tenant = tenant
        self.max_handles = max_handles
        self._handles: dict[int, _Handle] = {}
        self._next_handle = 1
        self._revoked: set[int] = set()  # handles to shared files that their owner took back

    def _add(self, file: KvFile, writable: bool) -> int:
        if len(self._handles) >= self.max_handles:
            raise LimitExceeded(f"too many open KV handles (limit {self.max_handles})")
        handle = self._next_handle
        self._next_handle += 1
        self.fs.acquire(file)
        self._handles[handle] = _Handle(file, writable)
        return handle

    def _get(self, handle: int) -> _Handle:
        entry = self._handles.get(handle) if isinstance(handle, int) else None
        if entry is None:
            if handle in self._revoked:
                raise BadHandle(f"KV handle {handle} was closed: its owner stopped sharing or removed the file")
            raise BadHandle(f"KV handle {handle!r} is not open in this process")
        return entry

    def _revoke(self, handle: int) -> None:
        """Close a handle to another tenant's file for its owner (KVFS.revoke_readers)."""
        self._revoked.add(handle)
        self.close(handle)

    def file_of(self, handle: int, write: bool = False) -> KvFile:
        """The file behind a handle; `write` demands a writable handle."""
        with self.fs.lock:
            entry = self._get(handle)
            if write and not entry.writable:
                raise ReadOnlyFile(f"KV handle {handle} is read-only; fork it to write")
            return entry.file

    def take_for_pred(self, handle: int) -> KvFile:
        """The file behind a writable handle, with a reference and an in-flight pred counted on
        it (the engine's `submit`; `KVFS.end_pred` ends both)."""
        with self.fs.lock:
            entry = self._handles.get(handle) if isinstance(handle, int) else None
            if entry is None:
                entry = self._get(handle)  # raises BadHandle
            if not entry.writable:
                raise ReadOnlyFile(f"KV handle {handle} is read-only; fork it to write")
            file = entry.file
            file.refs += 1  # KVFS.acquire, inline: once per pred
            file.last_used = self.fs.clock()
            file.inflight += 1
            return file

    def _new_handle_for_new_file(self) -> tuple[int, KvFile]:
        file = self.fs._new_file(self.tenant)
        try:
            return self._add(file, writable=True), file
        except LimitExceeded:
            self.fs._free_file(file)
            raise

    def create(self) -> int:
        """A new empty anonymous file; returns its handle."""
        with self.fs.lock:
            return self._new_handle_for_new_file()[0]

    def open(self, path: str, flags: int = OpenFlags.NONE) -> int:
        """Open a named file. CREATE makes it when missing (EXCLUSIVE: fail if it exists);
        READ_ONLY gives a handle that cannot append or truncate."""
        flags = OpenFlags(flags) if isinstance(flags, int) and 0 <= flags < 8 else None
        if flags is None:
            raise InvalidArgument("open flags must be a combination of CREATE=1, EXCLUSIVE=2, READ_ONLY=4")
        with self.fs.lock:
            owner, name = _split_path(self.tenant, path)
            file = self.fs._names.get((owner, name))
            foreign = owner != self.tenant
            if foreign:
                if file is None or not (self.tenant in file.shared_with or "*" in file.shared_with):
                    raise FileNotFound(f"no KV file {path!r} is shared with tenant {self.tenant!r}")
                if not flags & OpenFlags.READ_ONLY:
                    raise PermissionDenied(f"{path!r} is shared read-only: open it with READ_ONLY")
                handle = self._add(file, writable=False)
                file.readers = file.readers or {}
                file.readers[(self, handle)] = None
                return handle
            if file is not None:
                if flags & OpenFlags.CREATE and flags & OpenFlags.EXCLUSIVE:
                    raise FileExists(f"KV file {path!r} already exists")
                return self._add(file, writable=not flags & OpenFlags.READ_ONLY)
            if not flags & OpenFlags.CREATE:
                raise FileNotFound(f"no KV file named {path!r} (never created, removed or evicted)")
            file = self.fs._new_file(self.tenant, name)
            try:
                return self._add(file, writable=not flags & OpenFlags.READ_ONLY)
            except LimitExceeded:
                self.fs._unlink(file)
                self.fs._free_file(file)
                raise

    def fork(self, handle: int) -> int:
        """A new anonymous writable file with the same tokens; shares pages (copy-on-write)."""
        return self.extract(handle, 0, None)

    def extract(self, handle: int, start: int, end: int | None) -> int:
        """A new anonymous file holding tokens [start, end) of the file (end None: to the end)."""
        with self.fs.lock:
            src = self._get(handle).file
            end = src.length if end is None else end
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= src.length):
                raise InvalidArgument(f"extract range [{start}, {end}) is outside the file's {src.length} tokens")
            new, file = self._new_handle_for_new_file()
            try:
                self.fs.copy_range(src, start, end, file)
            except BaseException:
                self.close(new)
                raise
            return new

    def merge(self, first: int, second: int) -> int:
        """A new anonymous file: the tokens of `first` followed by those of `second`, each at
        its own positions."""
        with self.fs.lock:
            a, b = self._get(first).file, self._get(second).file
            new, file = self._new_handle_for_new_file()
            try:
                self.fs.copy_range(a, 0, a.length, file)
                self.fs.copy_range(b, 0, b.length, file)
            except BaseException:
                self.close(new)
                raise
            return new

    def truncate(self, handle: int, length: int) -> None:
        """Keep only the first `length` tokens."""
        with self.fs.lock:
            self.fs.truncate_file(self.file_of(handle, write=True), length)

    def len(self, handle: int) -> int:
        """Tokens in the file."""
        with self.fs.lock:
            return self._get(handle).file.length

    def close(self, handle: int) -> None:
        with self.fs.lock:
            entry = self._get(handle)
            del self._handles[handle]
            if entry.file.readers:
                entry.file.readers.pop((self, handle), None)
            self.fs.release(entry.file)

    def remove(self, path: str) -> None:
        """Remove a name; the file lives on while the owner's handles to it are open (other
        tenants' are closed)."""
        with self.fs.lock:
            owner, name = _split_path(self.tenant, path)
            if owner != self.tenant:
                raise PermissionDenied(f"only the owner can remove {path!r}")
            file = self.fs._names.get((owner, name))
            if file is None:
                raise FileNotFound(f"no KV file named {path!r}")
            self.fs._unlink(file)
            if file.refs == 0:
                self.fs._free_file(file)
            else:
                self.fs.revoke_readers(file)  # the last release frees it

    def set_hints(self, handle: int, **hints) -> None:
        """Set eviction hints (see EvictionHints) on the file behind a writable handle."""
        with self.fs.lock:
            file = self.file_of(handle, write=True)
            current = vars(file.hints).copy()
            unknown = set(hints) - set(current)
            if unknown:
                raise InvalidArgument(f"unknown eviction hints {sorted(unknown)}")
            current.update(hints)
            if current["keep_for_s"] is not None and not current["keep_for_s"] >= 0:
                raise InvalidArgument("keep_for_s must be >= 0 seconds")
            file.hints = EvictionHints(**current)
            file.last_used = self.fs.clock()

    def share(self, path: str, tenants: list[str]) -> None:
        """Share an own named file read-only with `tenants` ("*": everyone); [] un-shares. The
        handles of tenants it is no longer shared with are closed."""
        with self.fs.lock:
            file = self.fs._names.get((self.tenant, _validate_name(path)))
            if file is None:
                raise FileNotFound(f"no KV file named {path!r}")
            file.shared_with = frozenset(t if t == "*" else _validate_name(t) for t in tenants)
            self.fs.revoke_readers(file)

    def stat(self, handle_or_path: int | str) -> FileStat:
        with self.fs.lock:
            if isinstance(handle_or_path, int):
                return self.fs.stat_file(self._get(handle_or_path).file)
            owner, name = _split_path(self.tenant, handle_or_path)
            file = self.fs._names.get((owner, name))
            visible = file is not None and (
                owner == self.tenant or self.tenant in file.shared_with or "*" in file.shared_with
            )
            if not visible:
                raise FileNotFound(f"no KV file named {handle_or_path!r}")
            return self.fs.stat_file(file)

    def list(self, prefix: str = "") -> list[FileStat]:
        return self.fs.list_files(self.tenant, prefix)

    @property
    def open_handles(self) -> int:
        return len(self._handles)

    def pages_held(self, also=()) -> int:
        """Pages (in the pool or swapped out) of the files this session holds open and of the
        files in `also`, counted as quotas count them: pages shared by forks once, a page a file
        holds more than once each time (KVFS.charged_pages)."""
        with self.fs.lock:
            files = {entry.file for entry in self._handles.values()}.union(also)
            distinct = len({id(p) if isinstance(p, HostPage) else p for file in files for p in file.pages})
            return distinct + sum(file.repeated_pages for file in files)

    def files_in_flight(self) -> set[KvFile]:
        """The files behind this session's handles with a pred in flight (process exit)."""
        with self.fs.lock:
            return {entry.file for entry in self._handles.values() if entry.file.inflight}

    def close_all(self) -> None:
        """Close every handle this session still holds (process exit)."""
        with self.fs.lock:
            for handle in list(self._handles):
                self.close(handle)
