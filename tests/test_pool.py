"""The paged KV pool: allocation, reference counts, statistics, swap."""
import pytest
import torch

from symphony_os.errors import PoolExhausted
from symphony_os.kv.pool import KVPool


def make_pool(num_pages=8, page_size=4):
    return KVPool(num_layers=2, num_kv_heads=2, head_dim=4, num_pages=num_pages, page_size=page_size)


def test_allocate_and_free_return_pages():
    pool = make_pool()
    pages = pool.allocate(3)
    assert len(set(pages)) == 3
    assert pool.stats().used == 3 and pool.stats().free == 5
    pool.decref(pages)
    assert pool.stats().used == 0


def test_refcount_tracks_shared_pages():
    pool = make_pool()
    pages = pool.allocate(2)
    pool.incref(pages[:1])
    assert pool.stats().shared == 1
    pool.decref(pages[:1])
    assert pool.stats().shared == 0 and pool.stats().used == 2
    pool.decref(pages)
    assert pool.stats().used == 0


def test_exhausted_pool_raises_and_takes_nothing():
    pool = make_pool(num_pages=4)
    pool.allocate(3)
    with pytest.raises(PoolExhausted, match="need 2 pages, 1 free"):
        pool.allocate(2)
    assert pool.stats().free == 1


def test_reclaim_callback_runs_when_short():
    pool = make_pool(num_pages=2)
    held = pool.allocate(2)
    pool.reclaim = lambda n: pool.decref(held[:n])
    assert len(pool.allocate(1)) == 1


def test_copy_page_copies_every_layer():
    pool = make_pool()
    (src,) = pool.allocate(1)
    pool.k[:, src].normal_()
    pool.v[:, src].normal_()
    dst = pool.copy_page(src)
    assert dst != src
    assert torch.equal(pool.k[:, dst], pool.k[:, src]) and torch.equal(pool.v[:, dst], pool.v[:, src])


def test_swap_out_and_in_round_trips_contents():
    pool = make_pool()
    (page,) = pool.allocate(1)
    pool.k[:, page].normal_()
    pool.v[:, page].normal_()
    k, v = pool.k[:, page].clone(), pool.v[:, page].clone()
    host = pool.swap_out(page)
    assert pool.stats().used == 0 and pool.stats().swapped == 1
    pool.k.zero_()
    new = pool.swap_in(host)
    assert pool.stats().swapped == 0 and pool.stats().used == 1
    assert torch.equal(pool.k[:, new], k) and torch.equal(pool.v[:, new], v)


def test_bytes_per_page_counts_k_and_v_of_all_layers():
    pool = make_pool(page_size=4)
    assert pool.bytes_per_page == 2 * 2 * 4 * 2 * 4 * 4
