"""KVFS: the KV-cache file system over the paged pool."""
import itertools

import pytest
import torch

from symphony_os.errors import (BadHandle, FileBusy, FileExists, FileNotFound, InvalidArgument, LimitExceeded,
                                PermissionDenied, PoolExhausted, PositionError, ReadOnlyFile)
from symphony_os.kv import kvfs as kvfs_module
from symphony_os.kv.kvfs import KVFS, OpenFlags
from symphony_os.kv.pool import KVPool

PAGE = 4
_marks = itertools.count(1)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def fs(clock):
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, num_pages=16, page_size=PAGE)
    fs = KVFS(pool, clock=clock)
    yield fs
    # Nothing may leak: every test closes and removes what it made.
    assert pool.stats().used == 0 and pool.stats().swapped == 0, pool.stats()
    assert fs.file_count == 0


def write(fs, kv, handle, n, start=None):
    """Append n tokens with unique marks stored in their K and V; returns the marks."""
    file = kv.file_of(handle, write=True)
    start = file.next_position if start is None else start
    marks = [float(next(_marks)) for _ in range(n)]
    slots = fs.reserve_slots(file, list(range(start, start + n)))
    flat_k = fs.pool.k.view(2, -1, 1, 2)
    flat_v = fs.pool.v.view(2, -1, 1, 2)
    for slot, mark in zip(slots, marks):
        flat_k[:, slot] = mark
        flat_v[:, slot] = -mark
    return marks


def read(fs, kv, handle):
    """The marks of the file's tokens, checked equal in every layer and in K and V."""
    file = kv.file_of(handle)
    fs.ensure_resident(file)
    out = []
    for i in range(file.length):
        slot = file.pages[i // PAGE] * PAGE + i % PAGE
        k = fs.pool.k.view(2, -1, 1, 2)[:, slot]
        v = fs.pool.v.view(2, -1, 1, 2)[:, slot]
        assert torch.all(k == k.flatten()[0]) and torch.all(v == -k.flatten()[0])
        out.append(k.flatten()[0].item())
    return out


def test_create_write_len_close(fs):
    kv = fs.session()
    h = kv.create()
    marks = write(fs, kv, h, 6)
    assert kv.len(h) == 6
    assert read(fs, kv, h) == marks
    assert fs.pool.stats().used == 2
    kv.close(h)
    assert fs.pool.stats().used == 0


def test_fork_shares_pages_until_write(fs):
    kv = fs.session()
    h = kv.create()
    marks = write(fs, kv, h, 6)
    child = kv.fork(h)
    assert fs.pool.stats().used == 2 and fs.pool.stats().shared == 2
    assert read(fs, kv, child) == marks
    extra = write(fs, kv, child, 1)  # appends into the shared, partly filled second page
    assert fs.pool.stats().used == 3 and fs.pool.stats().shared == 1
    assert read(fs, kv, child) == marks + extra
    assert read(fs, kv, h) == marks  # the parent is untouched
    parent_extra = write(fs, kv, h, 3)
    assert read(fs, kv, h) == marks + parent_extra
    assert read(fs, kv, child) == marks + extra
    kv.close_all()


def test_fork_at_page_boundary_copies_nothing(fs):
    kv = fs.session()
    h = kv.create()
    write(fs, kv, h, 8)
    child = kv.fork(h)
    write(fs, kv, child, 1)
    assert fs.pool.stats().used == 3  # two shared full pages and one new page
    kv.close_all()


def test_extract_aligned_shares_and_unaligned_copies(fs):
    kv = fs.session()
    h = kv.create()
    marks = write(fs, kv, h, 10)
    aligned = kv.extract(h, 4, 9)
    assert read(fs, kv, aligned) == marks[4:9]
    assert kv.stat(aligned).next_position == 9
    unaligned = kv.extract(h, 3, 7)
    assert read(fs, kv, unaligned) == marks[3:7]
    assert kv.stat(unaligned).next_position == 7
    with pytest.raises(InvalidArgument):
        kv.extract(h, 5, 11)
    kv.close_all()


def test_merge_keeps_each_part_positions(fs):
    kv = fs.session()
    a, b = kv.create(), kv.create()
    ma = write(fs, kv, a, 5)
    mb = write(fs, kv, b, 3, start=100)
    merged = kv.merge(a, b)
    assert read(fs, kv, merged) == ma + mb
    file = kv.file_of(merged)
    assert [file.position_at(i) for i in range(8)] == [0, 1, 2, 3, 4, 100, 101, 102]
    assert file.next_position == 103
    more = write(fs, kv, merged, 2)
    assert read(fs, kv, merged) == ma + mb + more
    assert read(fs, kv, a) == ma and read(fs, kv, b) == mb
    kv.close_all()


def test_truncate_frees_pages_and_rewinds_position(fs):
    kv = fs.session()
    h = kv.create()
    marks = write(fs, kv, h, 10)
    kv.truncate(h, 5)
    assert kv.len(h) == 5 and read(fs, kv, h) == marks[:5]
    assert fs.pool.stats().used == 2
    assert kv.stat(h).next_position == 5
    again = write(fs, kv, h, 2)
    assert read(fs, kv, h) == marks[:5] + again
    with pytest.raises(InvalidArgument):
        kv.truncate(h, 8)
    kv.close_all()


def test_truncate_with_pred_in_flight_is_busy(fs):
    kv = fs.session()
    h = kv.create()
    write(fs, kv, h, 2)
    kv.file_of(h).inflight += 1
    with pytest.raises(FileBusy):
        kv.truncate(h, 1)
    kv.file_of(h).inflight -= 1
    kv.close_all()


def test_position_gaps_are_refused(fs):
    kv = fs.session()
    h = kv.create()
    write(fs, kv, h, 3)
    file = kv.file_of(h, write=True)
    with pytest.raises(PositionError, match="expected 3, got 5"):
        fs.reserve_slots(file, [5])
    with pytest.raises(PositionError, match="increase by one"):
        fs.reserve_slots(file, [3, 5])
    with pytest.raises(PositionError, match="non-negative"):
        fs.reserve_slots(kv.file_of(kv.create(), write=True), [-1])
    assert kv.len(h) == 3
    kv.close_all()


def test_named_files_open_flags(fs):
    kv = fs.session()
    with pytest.raises(FileNotFound):
        kv.open("sys/prompt")
    h = kv.open("sys/prompt", OpenFlags.CREATE | OpenFlags.EXCLUSIVE)
    marks = write(fs, kv, h, 5)
    with pytest.raises(FileExists):
        kv.open("sys/prompt", OpenFlags.CREATE | OpenFlags.EXCLUSIVE)
    kv.close(h)
    assert fs.pool.stats().used == 2  # a named file outlives its handles
    ro = kv.open("sys/prompt", OpenFlags.READ_ONLY)
    assert read(fs, kv, ro) == marks
    with pytest.raises(ReadOnlyFile):
        kv.truncate(ro, 1)
    with pytest.raises(ReadOnlyFile):
        kv.file_of(ro, write=True)
    child = kv.fork(ro)  # forks of read-only files are writable
    write(fs, kv, child, 1)
    assert [s.name for s in kv.list()] == ["sys/prompt"]
    kv.close_all()
    kv.remove("sys/prompt")
    with pytest.raises(FileNotFound):
        kv.remove("sys/prompt")


def test_remove_while_open_keeps_data_until_close(fs):
    kv = fs.session()
    h = kv.open("doc", OpenFlags.CREATE)
    marks = write(fs, kv, h, 3)
    kv.remove("doc")
    assert kv.list() == [] and read(fs, kv, h) == marks
    kv.close(h)


@pytest.mark.parametrize("name", ["", "..", "a/../b", "/abs", "a//b", "nul\x00", "x" * 300, "sp ace", "a/./b"])
def test_bad_names_are_refused(fs, name):
    kv = fs.session()
    with pytest.raises(InvalidArgument):
        kv.open(name, OpenFlags.CREATE)


def test_closed_stale_and_foreign_handles_are_refused(fs):
    kv, other = fs.session("alice"), fs.session("bob")
    h = kv.create()
    kv.close(h)
    for bad in (h, 0, -1, 99999, "1", None):
        with pytest.raises(BadHandle):
            kv.len(bad)
    mine = kv.create()
    with pytest.raises(BadHandle):
        other.close(mine + 1000)
    with pytest.raises(BadHandle):
        kv.close(h)  # double close
    kv.close_all()


def test_tenants_are_isolated_and_can_share_read_only(fs):
    alice, bob, carol = fs.session("alice"), fs.session("bob"), fs.session("carol")
    h = alice.open("docs/intro", OpenFlags.CREATE)
    marks = write(fs, alice, h, 5)
    with pytest.raises(FileNotFound):
        bob.open("docs/intro")  # bob's namespace has no such file
    with pytest.raises(FileNotFound):
        bob.open("@alice/docs/intro", OpenFlags.READ_ONLY)  # not shared yet
    alice.share("docs/intro", ["bob"])
    with pytest.raises(PermissionDenied):
        bob.open("@alice/docs/intro")  # only read-only
    ro = bob.open("@alice/docs/intro", OpenFlags.READ_ONLY)
    assert read(fs, bob, ro) == marks
    with pytest.raises(PermissionDenied):
        bob.remove("@alice/docs/intro")
    with pytest.raises(FileNotFound):
        carol.open("@alice/docs/intro", OpenFlags.READ_ONLY)
    assert [s.name for s in bob.list()] == ["docs/intro"] and carol.list() == []
    for kv in (alice, bob):
        kv.close_all()
    alice.remove("docs/intro")


def test_the_owner_takes_a_shared_file_back_from_readers_holding_it_open(fs):
    """A reader's open handle kept the owner's pages, charged to the owner's quota, after the
    owner stopped sharing the file and even removed it. Un-sharing closes the handles of the
    tenants it is no longer shared with; removing closes every other tenant's."""
    fs.page_quota["alice"] = 4
    alice, bob, carol = fs.session("alice"), fs.session("bob"), fs.session("carol")
    h = alice.open("docs/intro", OpenFlags.CREATE)
    write(fs, alice, h, 16)  # the whole quota
    alice.close(h)
    alice.share("docs/intro", ["bob", "carol"])
    by_bob = bob.open("@alice/docs/intro", OpenFlags.READ_ONLY)
    by_carol = carol.open("@alice/docs/intro", OpenFlags.READ_ONLY)
    alice.share("docs/intro", ["carol"])  # bob's handle goes, carol's stays
    with pytest.raises(BadHandle, match="its owner stopped sharing or removed the file"):
        bob.len(by_bob)
    assert carol.len(by_carol) == 16 and bob.open_handles == 0
    alice.remove("docs/intro")
    with pytest.raises(BadHandle, match="its owner stopped sharing or removed the file"):
        carol.len(by_carol)
    assert fs.pages_of("alice") == 0  # freed: alice may use her quota again
    h = alice.create()
    write(fs, alice, h, 16)
    alice.close_all()


def test_handle_limit(fs):
    kv = fs.session(max_handles=2)
    kv.create(), kv.create()
    with pytest.raises(LimitExceeded):
        kv.create()
    with pytest.raises(LimitExceeded):
        kv.open("x", OpenFlags.CREATE)
    assert fs.file_count == 2
    kv.close_all()


def test_drop_on_close_removes_named_file(fs):
    kv = fs.session()
    h = kv.open("tmp", OpenFlags.CREATE)
    write(fs, kv, h, 3)
    kv.set_hints(h, drop_on_close=True)
    kv.close(h)
    assert kv.list() == []


def _named(fs, kv, name, n, **hints):
    h = kv.open(name, OpenFlags.CREATE)
    write(fs, kv, h, n)
    if hints:
        kv.set_hints(h, **hints)
    kv.close(h)


def test_pool_pressure_evicts_closed_named_files_lru(fs, clock):
    kv = fs.session()
    for i, name in enumerate(["old", "mid", "new"]):
        clock.now += 1
        _named(fs, kv, name, 16)  # 4 pages each: 12 of 16 used
    h = kv.create()
    write(fs, kv, h, 20)  # needs 5 pages: the least recently used file goes
    assert [s.name for s in kv.list()] == ["mid", "new"]
    assert fs.evicted_files == 1
    kv.close_all()
    kv.remove("mid"), kv.remove("new")


def test_pinned_priority_and_keep_for(fs, clock):
    kv = fs.session()
    _named(fs, kv, "pinned", 16, pinned=True)
    _named(fs, kv, "kept", 16, keep_for_s=10)
    _named(fs, kv, "low", 16, priority=-1)
    _named(fs, kv, "normal", 16)  # the pool is full
    clock.now += 1
    h = kv.create()
    write(fs, kv, h, 8)  # 2 pages wanted, 0 free: the low-priority file goes first
    assert sorted(s.name for s in kv.list()) == ["kept", "normal", "pinned"]
    clock.now += 20  # past its keep-for window: "kept" is now the first to go
    write(fs, kv, h, 24)
    assert sorted(s.name for s in kv.list()) == ["normal", "pinned"]
    kv.close_all()
    kv.remove("normal"), kv.remove("pinned")


def test_pool_pressure_evicts_from_the_tenant_holding_the_most_first(fs, clock):
    """Hints order a tenant's own files; across tenants, the one holding the most pages gives
    first. (One global order by hints let a tenant's old files at the highest priority outlive
    another tenant's file used a moment ago, and shield as much as the pool holds.)"""
    alice, bob = fs.session("alice"), fs.session("bob")
    _named(fs, bob, "old-1", 16, priority=2**31 - 1)
    _named(fs, bob, "old-2", 16, priority=2**31 - 1)
    clock.now += 3600
    _named(fs, alice, "recent", 16)  # 12 of 16 pages used
    h = alice.create()
    write(fs, alice, h, 20)  # needs 5 pages: one file goes, and it is one of bob's
    assert [s.name for s in alice.list()] == ["recent"] and len(bob.list()) == 1
    write(fs, alice, h, 16)  # 4 more: alice holds the most now (9 against 4), so hers goes
    assert alice.list() == [] and len(bob.list()) == 1
    alice.close_all()
    bob.remove(bob.list()[0].name)


def test_pool_pressure_swaps_open_files_and_swaps_them_back(fs):
    kv = fs.session()
    idle = kv.create()
    idle_marks = write(fs, kv, idle, 40)  # 10 pages, open but unused
    busy = kv.create()
    busy_marks = write(fs, kv, busy, 40)  # needs 10: 6 free, so 4 of idle's pages go to host
    assert fs.pool.stats().swapped == 4 and kv.stat(idle).swapped_pages == 4
    kv.close(busy)
    assert read(fs, kv, idle) == idle_marks  # swapped back in on use
    assert fs.pool.stats().swapped == 0
    assert len(busy_marks) == 40
    kv.close_all()


def test_pool_pressure_swaps_from_the_tenant_with_the_most_pages_in_the_pool_first(fs):
    """As for eviction: a tenant's priority orders its own open files only. (One order across
    tenants swapped another tenant's small file out first because it had the lower priority.)"""
    alice, bob, carol = fs.session("alice"), fs.session("bob"), fs.session("carol")
    big = alice.create()
    write(fs, alice, big, 36)  # 9 pages
    alice.set_hints(big, priority=2**31 - 1)
    small = bob.create()
    write(fs, bob, small, 8)  # 2 pages: 11 of 16 used
    h = carol.create()
    write(fs, carol, h, 28)  # 7 pages: 2 must go to host memory, and they are alice's
    assert alice.stat(big).swapped_pages == 2 and bob.stat(small).swapped_pages == 0
    for kv in (alice, bob, carol):
        kv.close_all()


def test_swapping_to_host_memory_stops_at_max_swapped(fs):
    """Open files past the pool go to host memory only up to pool.max_swapped pages: past it
    an allocation fails with PoolExhausted (nothing half done), not with the host's memory."""
    fs.pool.max_swapped = 4
    kv = fs.session()
    idle = kv.create()
    idle_marks = write(fs, kv, idle, 40)  # 10 pages, open but unused
    busy = kv.create()
    write(fs, kv, busy, 40)  # needs 10: 6 free, so 4 of idle's pages go to host: the limit
    other = kv.create()
    with pytest.raises(PoolExhausted):
        write(fs, kv, other, 4)  # one more page would need a 5th swapped page
    assert fs.pool.stats().swapped == 4 and kv.file_of(other).length == 0
    kv.close(busy)
    assert read(fs, kv, idle) == idle_marks
    kv.close_all()


def test_sharing_swapped_pages_past_max_swapped_is_refused_before_anything_is_shared(fs):
    """A second file's copy of host pages counts against max_swapped too (copy_range swaps its
    source in first, so this is the guard behind it)."""
    kv = fs.session()
    a = kv.create()
    write(fs, kv, a, 40)
    b = kv.create()
    write(fs, kv, b, 40)  # 4 of a's pages go to host memory
    fs.pool.max_swapped = 5
    with fs.lock, pytest.raises(PoolExhausted, match="limit of 5"):
        fs._share_pages(kv.file_of(a).pages)  # 4 more host copies would make 8
    assert fs.pool.stats().swapped == 4
    kv.close_all()


def test_protection_is_counted_across_overlapping_blocks(fs):
    """A file protected by two blocks stays protected until both end (the engine's block
    spans a forward pass, without the lock, while another may start and end)."""
    kv = fs.session()
    idle = kv.create()
    idle_marks = write(fs, kv, idle, 40)  # 10 pages, open but unused: swappable
    file = kv.file_of(idle)
    first, second = fs.protect([file]), fs.protect([file])
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # the first block ends while the second still runs
    busy = kv.create()
    with pytest.raises(PoolExhausted):  # the only pages to take are the protected file's
        write(fs, kv, busy, 40)
    assert kv.stat(idle).swapped_pages == 0
    second.__exit__(None, None, None)
    write(fs, kv, busy, 40)  # now they may go to the host
    assert kv.stat(idle).swapped_pages == 4 and read(fs, kv, idle) == idle_marks
    kv.close_all()


def test_exhausted_pool_after_eviction_raises_and_keeps_data(fs):
    kv = fs.session()
    h = kv.create()
    kv.set_hints(h, pinned=True)
    marks = write(fs, kv, h, 60)
    with pytest.raises(PoolExhausted):
        write(fs, kv, h, 8)
    assert read(fs, kv, h) == marks
    kv.close_all()


def test_fork_of_swapped_file(fs):
    kv = fs.session()
    a = kv.create()
    marks = write(fs, kv, a, 40)
    b = kv.create()
    write(fs, kv, b, 40)
    assert kv.stat(a).swapped_pages
    child = kv.fork(a)
    assert read(fs, kv, child) == marks
    kv.close_all()


def test_stat_reports_file(fs):
    kv = fs.session()
    h = kv.open("s", OpenFlags.CREATE)
    write(fs, kv, h, 5)
    kv.set_hints(h, priority=3)
    st = kv.stat("s")
    assert (st.name, st.owner, st.length, st.pages, st.open_handles, st.hints.priority) == ("s", "default", 5, 2, 1, 3)
    with pytest.raises(InvalidArgument):
        kv.set_hints(h, colour="red")
    kv.close_all()
    kv.remove("s")


def test_page_quota_counts_forked_pages_once_and_evicts_the_tenants_own_cache_first(fs, clock):
    fs.page_quota["t"] = 4
    kv = fs.session("t")
    root = kv.create()
    write(fs, kv, root, 3 * PAGE)
    forks = [kv.fork(root) for _ in range(3)]  # 3 pages, however many files share them
    assert fs.pages_of("t") == 3
    with fs.lock:  # a host-side cache of t (owner "t:prefix") shares the same pages
        fs.save_copy(kv.file_of(root), 0, 2 * PAGE, "t:prefix", "block")
    assert fs.pages_of("t") == 3
    for fork in forks:
        kv.close(fork)
    write(fs, kv, root, 1)  # the 4th page fits
    kv.truncate(root, PAGE)
    clock.now += 1
    write(fs, kv, root, 3 * PAGE)  # 3 new pages: the cache's 2nd page must go for them
    assert fs.pages_of("t") == 4 and fs.lookup("t:prefix", "block") is None
    with pytest.raises(LimitExceeded, match="KV page quota"):
        write(fs, kv, root, PAGE)
    kv.close(root)
    assert fs.pages_of("t") == 0


def test_named_file_quota_bounds_the_names_a_tenant_keeps(fs, monkeypatch):
    """An empty named file holds no page, so the page quota cannot bound them: a tenant keeps at
    most its file_quota of names (default kvfs.DEFAULT_MAX_NAMED_FILES)."""
    fs.file_quota["t"] = 3
    kv, other = fs.session("t"), fs.session("u")
    for i in range(3):
        kv.close(kv.open(f"f{i}", OpenFlags.CREATE))
    with pytest.raises(LimitExceeded, match="named KV file quota of tenant 't': it keeps 3 of 3"):
        kv.open("f3", OpenFlags.CREATE)
    kv.close(kv.open("f0", OpenFlags.CREATE))  # opening a name it has is no new name
    kv.close(kv.create())  # anonymous files do not count
    with fs.lock:  # nor do the tenant's host-side caches (each of their files holds a page)
        source = fs.session("t")
        handle = source.create()
        write(fs, source, handle, PAGE)
        assert fs.save_copy(source.file_of(handle), 0, PAGE, "t:prefix", "block")
        source.close(handle)
    kv.remove("f1")
    kv.close(kv.open("f3", OpenFlags.CREATE))  # a removed name makes room
    monkeypatch.setattr(kvfs_module, "DEFAULT_MAX_NAMED_FILES", 2)
    other.close(other.open("g0", OpenFlags.CREATE))
    other.close(other.open("g1", OpenFlags.CREATE))
    with pytest.raises(LimitExceeded, match="tenant 'u': it keeps 2 of 2"):  # the default, for a tenant without one
        other.open("g2", OpenFlags.CREATE)
    for name in ("f0", "f2", "f3"):  # the fixture checks that nothing is left
        kv.remove(name)
    for name in ("g0", "g1"):
        other.remove(name)
    with fs.lock:  # the cache's block goes as eviction would take it
        block = fs.lookup("t:prefix", "block")
        fs._unlink(block)
        fs._free_file(block)


def test_a_file_merged_with_itself_pays_for_each_page_it_holds_again(fs):
    """Quotas counted distinct pages, so merging a file with itself doubled its tokens for
    free: 18 merges made 4,194,304 tokens out of one page under an 8-page quota, and every batch
    that file joined attended over all of them. A page a file holds again is charged again."""
    fs.page_quota["t"] = 8
    kv = fs.session("t")
    h = kv.create()
    write(fs, kv, h, PAGE)
    merges = 0
    with pytest.raises(LimitExceeded, match="KV page quota of tenant 't'"):
        for _ in range(18):
            merged = kv.merge(h, h)
            kv.close(h)
            h, merges = merged, merges + 1
    # 2 then 4 references to the page; 8 more, while the 4 are open, are past the quota.
    assert merges == 2 and kv.len(h) == 4 * PAGE and fs.pages_of("t") == 4
    fork = kv.fork(h)  # a fork holds each page as many times as its source: charged as often
    assert kv.len(fork) == 4 * PAGE and fs.pages_of("t") == 7
    kv.close_all()
    assert fs.pages_of("t") == 0


def test_repeated_pages_are_charged_until_the_file_lets_them_go(fs):
    fs.page_quota["t"] = 6
    kv = fs.session("t")
    h = kv.create()
    write(fs, kv, h, 2 * PAGE)
    twice = kv.merge(h, h)  # pages a b a b: 2 distinct, 2 repeats
    kv.close(h)
    assert fs.pages_of("t") == 4 and kv.pages_held() == 4
    kv.truncate(twice, 3 * PAGE)  # a b a
    assert fs.pages_of("t") == 3
    write(fs, kv, twice, 1)  # the last page was shared: copied on write, a fresh page
    assert fs.pages_of("t") == 4 and kv.len(twice) == 3 * PAGE + 1
    kv.truncate(twice, 2 * PAGE)
    assert fs.pages_of("t") == 2
    kv.close_all()


def test_a_file_holds_at_most_the_models_context(clock):
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, num_pages=16, page_size=PAGE)
    fs = KVFS(pool, clock=clock, max_file_tokens=3 * PAGE)
    kv = fs.session()
    h = kv.create()
    write(fs, kv, h, 2 * PAGE)
    with pytest.raises(LimitExceeded, match=f"at most {3 * PAGE} tokens"):
        kv.merge(h, h)
    write(fs, kv, h, PAGE)
    with pytest.raises(LimitExceeded, match="the model's context"):
        write(fs, kv, h, 1)
    assert kv.len(h) == 3 * PAGE and fs.file_count == 1  # the refused merge left no file
    kv.close_all()
    assert pool.stats().used == 0


def test_positions_stop_at_32_bits_even_when_a_file_is_continued(fs):
    kv = fs.session()
    h = kv.create()
    write(fs, kv, h, 2, start=kvfs_module.MAX_POSITION - 1)
    with fs.lock, pytest.raises(PositionError, match="positions end at"):
        fs.reserve_next(kv.file_of(h), 0.0)  # how the engine continues a file
    kv.close_all()


def test_a_decode_step_takes_the_next_position_and_its_slot(fs, clock):
    """KVFS.reserve_next, the engine's decode step: in the file's own last page, in a new page
    at a page boundary, in a copy of a last page a fork shares; refused past the file bound."""
    kv = fs.session()
    h = kv.create()
    write(fs, kv, h, PAGE + 1)
    file = kv.file_of(h, write=True)
    with fs.lock:
        assert fs.reserve_next(file, clock()) == (PAGE + 1, file.pages[1] * PAGE + 1)
        for _ in range(PAGE - 2):
            fs.reserve_next(file, clock())
        assert fs.reserve_next(file, clock()) == (2 * PAGE, file.pages[2] * PAGE)  # a new page
    assert file.length == 2 * PAGE + 1 and file.next_position == 2 * PAGE + 1
    forked = kv.file_of(kv.fork(h), write=True)
    shared = forked.pages[-1]
    with fs.lock:
        position, slot = fs.reserve_next(forked, clock())
    assert position == 2 * PAGE + 1 and forked.pages[-1] != shared and slot == forked.pages[-1] * PAGE + 1
    assert file.pages[-1] == shared and file.length == 2 * PAGE + 1  # the original is untouched
    kv.close_all()
    bounded = KVFS(fs.pool, clock=clock, max_file_tokens=PAGE + 2)
    session = bounded.session()
    b = session.create()
    write(bounded, session, b, PAGE + 2)
    with bounded.lock, pytest.raises(LimitExceeded, match="the model's context"):
        bounded.reserve_next(session.file_of(b, write=True), clock())
    session.close_all()
