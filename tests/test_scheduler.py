"""The batch scheduler's policy, on plain requests (no model)."""
from symphony_os.engine.sampling import Sample
from symphony_os.engine.scheduler import BatchScheduler, PredRequest
from symphony_os.kv.kvfs import KvFile


def request(file_id, n, tenant="t"):
    return PredRequest(KvFile(file_id, tenant, None, 0.0), list(range(n)), None, Sample())


def plan_of(scheduler):
    return [(c.request, c.start, c.count) for c in scheduler.schedule().chunks]


def test_decodes_go_first_then_prefill_fills_the_budget():
    s = BatchScheduler(token_budget=10)
    prefill, d1, d2 = request(1, 30), request(2, 1), request(3, 1)
    for r in (prefill, d1, d2):
        s.add(r)
    assert plan_of(s) == [(d1, 0, 1), (d2, 0, 1), (prefill, 0, 8)]


def test_chunked_prefill_continues_where_it_stopped():
    s = BatchScheduler(token_budget=8)
    r = request(1, 20)
    s.add(r)
    assert plan_of(s) == [(r, 0, 8)]
    r.done = 8
    assert plan_of(s) == [(r, 8, 8)]
    r.done = 16
    assert plan_of(s) == [(r, 16, 4)]


def test_one_request_per_file_per_batch_in_arrival_order():
    s = BatchScheduler(token_budget=100)
    shared = KvFile(7, "t", None, 0.0)
    first = PredRequest(shared, [1, 2, 3], None, Sample())
    second = PredRequest(shared, [4], None, Sample())  # a decode, but it must wait for `first`
    other = request(8, 1)
    for r in (first, second, other):
        s.add(r)
    assert plan_of(s) == [(other, 0, 1), (first, 0, 3)]


def test_batch_size_cap():
    s = BatchScheduler(token_budget=100, max_batch_size=2)
    rs = [request(i, 1) for i in range(5)]
    for r in rs:
        s.add(r)
    assert plan_of(s) == [(rs[0], 0, 1), (rs[1], 0, 1)]


def test_empty_queue_plans_nothing():
    assert BatchScheduler().schedule() is None


def test_prefill_budget_is_shared_among_tenants_before_arrival_order_fills_it():
    """A tenant's long prompts queued first do not hold another tenant's short one back for
    their whole length: each tenant with prefill work gets a share of the batch's budget
    (its requests in arrival order), and what is left goes in arrival order."""
    s = BatchScheduler(token_budget=512)
    hog = [request(i, 10_000, "hog") for i in range(3)]
    short, decode = request(10, 20, "other"), request(11, 1, "hog")
    for r in (*hog, short, decode):
        s.add(r)
    assert plan_of(s) == [(decode, 0, 1), (hog[0], 0, 491), (short, 0, 20)]


def test_one_tenant_alone_is_served_in_arrival_order_as_before():
    s = BatchScheduler(token_budget=512)
    first, second = request(1, 300), request(2, 400)
    for r in (first, second):
        s.add(r)
    assert plan_of(s) == [(first, 0, 300), (second, 0, 212)]


def test_the_shares_keep_a_files_requests_in_order():
    """A tenant whose share went to one file's request does not, in the shared round, get a
    later request of a file whose earlier request it skipped; the rest of the budget then
    grows the chunks of the shares first, in arrival order."""
    s = BatchScheduler(token_budget=100)
    file_a, file_b = KvFile(1, "t", None, 0.0), KvFile(2, "t", None, 0.0)
    a1 = PredRequest(file_a, list(range(300)), None, Sample())
    b1 = PredRequest(file_b, list(range(300)), None, Sample())
    a2 = PredRequest(file_a, list(range(5)), None, Sample())
    other = request(3, 10, "u")
    for r in (a1, b1, a2, other):
        s.add(r)
    assert plan_of(s) == [(a1, 0, 90), (other, 0, 10)]


def test_the_rest_of_the_budget_grows_a_shared_chunk_rather_than_being_left():
    s = BatchScheduler(token_budget=512)
    long, short = request(1, 1000, "a"), request(2, 10, "b")
    for r in (long, short):
        s.add(r)
    assert plan_of(s) == [(long, 0, 502), (short, 0, 10)]


def test_one_tenants_decodes_cannot_hold_back_anothers_prompt():
    """Decodes went first and filled the batch: one process with 256 forks kept every batch
    full of its one-token decodes, and another tenant's 16-token prompt waited for as long as
    the flood lasted (13.5 s of 15). With several tenants waiting, each one's decodes take at
    most its share of the batch; what the others leave, the flood gets back."""
    s = BatchScheduler(token_budget=512, max_batch_size=256)
    flood = [request(i, 1, "flood") for i in range(300)]
    prompt = request(1000, 16, "other")
    for r in (*flood, prompt):
        s.add(r)
    plan = plan_of(s)
    assert (prompt, 0, 16) in plan
    assert [r for r, _, _ in plan if r is not prompt] == flood[:255]  # every seat left, in arrival order


def test_tenants_flooding_with_decodes_share_the_seats():
    s = BatchScheduler(token_budget=512, max_batch_size=8)
    a = [request(i, 1, "a") for i in range(10)]
    b = [request(100 + i, 1, "b") for i in range(10)]
    c = request(200, 1, "c")
    for r in (*a, *b, c):
        s.add(r)
    plan = [r for r, _, _ in plan_of(s)]
    assert plan == a[:2] + b[:2] + [c] + a[2:5]  # two seats each, then the rest in arrival order
    s.remove_all(plan)
    assert [r for r, _, _ in plan_of(s)] == a[5:9] + b[2:6]  # now two tenants: four seats each


def test_a_deferred_decode_keeps_its_files_order():
    """A decode the share held back is not overtaken by a later request on its file."""
    s = BatchScheduler(token_budget=512, max_batch_size=2)
    shared = KvFile(1, "a", None, 0.0)
    first = PredRequest(shared, [1], None, Sample())
    other_a = request(2, 1, "a")
    later = PredRequest(shared, [2], None, Sample())
    b = request(3, 1, "b")
    for r in (other_a, first, later, b):
        s.add(r)
    assert [r for r, _, _ in plan_of(s)] == [other_a, b]
    s.remove_all([other_a, b])
    assert [r for r, _, _ in plan_of(s)] == [first]
