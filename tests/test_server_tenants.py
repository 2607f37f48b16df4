"""Tenants of one server: many processes at once, isolation (each attempt on another tenant's
programs, processes and KV files refused), read-only sharing, and quotas."""
import asyncio
import struct
import threading

import httpx
import pytest
from guests import ECHO, lip, wat
from served import SMALL_QUOTAS, TIGHT_QUOTAS, TOKENS, served, wait_until  # noqa: F401 (fixture)

from symphony_os.client.client import AsyncClient, Client, ServerError

SPIN = wat('(module (memory (export "memory") 1) (func (export "_start") (loop $l (br $l))))')


def kv_probe(call: str, path: str, flags: int = 4) -> bytes:
    """A LIP that calls kv_open(path, flags) or kv_remove(path) and sends the i32 result."""
    args = "(i32.const 16) (i32.const %d)" % len(path) + (f" (i32.const {flags})" if call == "kv_open" else "")
    params = "i32 i32 i32" if call == "kv_open" else "i32 i32"
    return wat(f'''(module
      (import "symphony" "{call}" (func $call (param {params}) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "{path}")
      (func (export "_start")
        (i32.store (i32.const 0) (call $call {args}))
        (drop (call $send (i32.const 0) (i32.const 4)))))''')


def probe(client: Client, call: str, path: str, flags: int = 4) -> int:
    result = client.run(client.upload(kv_probe(call, path, flags), "probe")["sha256"])
    assert result.exit_code == 0, result
    return struct.unpack("<i", result.output)[0]


@pytest.fixture
def clients(served):
    opened = {name: Client(served.url, token) for name, token in TOKENS.items()}
    yield opened
    for client in opened.values():
        client.close()


def test_four_tenants_run_100_processes_at_once_and_every_output_is_right(served, clients):
    names = ["Tom", "Lily", "Sue", "Ben", "Max", "Mia", "Sam", "Ann"]
    prompts = [f"{name} went to the" for name in names]
    sha = clients["alice"].upload(lip("hello"))["sha256"]
    alone = {p: clients["alice"].run(sha, [p, "10"]).output for p in prompts}
    tenants = ["alice", "bob", "carol", "dave"]

    async def run_all():
        async def one(client, prompt):
            return prompt, await client.run(sha, [prompt, "10"])

        async with AsyncClient(served.url, TOKENS["alice"]) as a, AsyncClient(served.url, TOKENS["bob"]) as b, \
                AsyncClient(served.url, TOKENS["carol"]) as c, AsyncClient(served.url, TOKENS["dave"]) as d:
            by_tenant = dict(zip(tenants, (a, b, c, d)))
            for client in (b, c, d):
                assert (await client.upload(lip("hello")))["sha256"] == sha
            jobs = [one(by_tenant[tenants[i % 4]], prompts[i % 8]) for i in range(100)]
            return await asyncio.gather(*jobs)

    batches_before = served.engine.stats().batches
    results = asyncio.run(run_all())
    assert len(results) == 100
    for prompt, result in results:
        assert result.exit_code == 0 and result.output == alone[prompt], (prompt, result)
    assert served.engine.stats().batches - batches_before < 100 * 11 / 4  # they shared batches


def test_a_tenant_cannot_read_open_list_kill_or_remove_another_tenants_things(served, clients):
    alice, bob = clients["alice"], clients["bob"]
    # bob's program, a running process of his, and a named KV file of his.
    bob_echo = bob.upload(kv_probe("kv_open", "x"), "bobs")["sha256"]
    bob_hold = bob.upload(SPIN, "spin")["sha256"]
    # Each tenant numbers its own processes: a number none of alice's has, so that a 404 means
    # that bob's is out of her reach (under one of hers she would find her own).
    alice_pids = [p["pid"] for p in alice.ps(all=True)]
    bob_pid = bob.launch(bob_hold, detached=True)["pid"]
    while bob_pid <= max(alice_pids, default=0):
        bob.kill(bob_pid)
        bob_pid = bob.launch(bob_hold, detached=True)["pid"]
    assert bob.run(bob.upload(lip("parallel"))["sha256"], ["A bird.", "2", "Hi"]).exit_code == 0
    bob_file = next(f["path"] for f in bob.kv_ls("prefix/"))

    def refused(call, status, reason):
        with pytest.raises(ServerError) as error:
            call()
        assert error.value.status == status and reason in error.value.reason, error.value

    # programs: not listed, not readable, not launchable, not deletable
    assert bob_echo not in [p["sha256"] for p in alice.programs()]
    as_alice = {"Authorization": f"Bearer {TOKENS['alice']}"}
    assert httpx.get(f"{served.url}/programs/{bob_echo}", headers=as_alice).status_code == 404
    assert httpx.delete(f"{served.url}/programs/{bob_echo}", headers=as_alice).status_code == 404
    refused(lambda: alice.launch(bob_echo), 404, "no program")
    # processes: not listed, not inspectable, not killable, not attachable
    assert bob_pid not in [p["pid"] for p in alice.ps(all=True)]
    refused(lambda: alice.inspect(bob_pid), 404, "no process")
    refused(lambda: alice.kill(bob_pid), 404, "no process")
    refused(lambda: next(alice.attach(bob_pid)), 404, "no process")
    assert bob.inspect(bob_pid)["state"] == "runnable"
    # KV files: not listed, not removable by name or as @bob/..., not openable by a LIP
    assert not any(bob_file in f["path"] for f in alice.kv_ls())
    refused(lambda: alice.kv_rm(bob_file), 404, "no KV file")
    refused(lambda: alice.kv_rm(f"@bob/{bob_file}"), 403, "only the owner")
    assert probe(alice, "kv_open", f"@bob/{bob_file}") == -5  # file-not-found
    assert probe(alice, "kv_open", f"@bob/{bob_file}", flags=0) == -5
    assert probe(alice, "kv_remove", f"@bob/{bob_file}") == -6  # permission-denied
    assert bob_file in [f["path"] for f in bob.kv_ls()]
    # shared read-only, alice may open it (read-only) and see it, still not remove it
    bob.kv_share(bob_file, ["alice"])
    assert f"@bob/{bob_file}" in [f["path"] for f in alice.kv_ls()]
    assert probe(alice, "kv_open", f"@bob/{bob_file}") > 0
    assert probe(alice, "kv_open", f"@bob/{bob_file}", flags=0) == -6
    assert f"@bob/{bob_file}" not in [f["path"] for f in clients["carol"].kv_ls()]
    refused(lambda: alice.kv_rm(f"@bob/{bob_file}"), 403, "only the owner")
    bob.kill(bob_pid)
    bob.kv_rm(bob_file)


def test_requests_without_a_valid_token_get_401(served):
    for headers in ({}, {"Authorization": "Bearer not-a-token"}, {"Authorization": "Basic abc"}):
        for method, path in (("get", "/programs"), ("get", "/processes"), ("get", "/kv"), ("post", "/processes")):
            response = getattr(httpx, method)(served.url + path, headers=headers)
            assert response.status_code == 401 and "bearer token" in response.json()["detail"]
    with Client(served.url, "not-a-token") as stranger, pytest.raises(ServerError) as refused:
        next(stranger.attach(1))
    assert refused.value.status == 401


def test_quotas_are_enforced_with_clear_errors(served, clients):
    tight = clients["tight"]
    # upload bytes
    with pytest.raises(ServerError) as refused:
        tight.upload(lip("hello"))
    assert refused.value.status == 403 and "upload quota" in refused.value.reason
    assert tight.programs() == []
    spin = tight.upload(SPIN, "spin")["sha256"]
    # CPU time per process, and running processes while it runs
    pid = tight.launch(spin, detached=True)["pid"]
    with pytest.raises(ServerError) as refused:
        tight.launch(spin)
    assert refused.value.status == 403 and "process quota" in refused.value.reason
    info = wait_until(lambda: (i := tight.inspect(pid))["state"] == "killed" and i, timeout_s=60)
    assert info and info["end_reason"] == f"killed: cpu time limit {TIGHT_QUOTAS['cpu_time_s']}s exceeded"
    # KV pages: 40 tokens need 3 pages of 16, the quota is 2; the pred fails with limit-exceeded
    hold = wat('''(module
      (import "symphony" "kv_create" (func $create (result i32)))
      (import "symphony" "pred_submit" (func $submit (param i32 i32 i32 i32 i32 i32) (result i32)))
      (import "symphony" "pred_wait" (func $wait (param i32 i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "''' + "\\01\\00\\00\\00" * 40 + '''")
      (func (export "_start") (local $kv i32)
        (local.set $kv (call $create))
        (i32.store (i32.const 0) (call $wait (call $submit (local.get $kv) (i32.const 16) (i32.const 0)
                                         (i32.const 20) (i32.const 2) (i32.const 0)) (i32.const 0) (i32.const 0)))
        (i32.store (i32.const 4) (call $wait (call $submit (local.get $kv) (i32.const 16) (i32.const 0)
                                         (i32.const 20) (i32.const 2) (i32.const 0)) (i32.const 0) (i32.const 0)))
        (drop (call $send (i32.const 0) (i32.const 8)))))''')
    result = tight.run(tight.upload(hold, "hold")["sha256"])
    first, second = struct.unpack("<2i", result.output)
    assert first >= 0 and second == -12  # limit-exceeded: 20 tokens fit in 2 pages, 40 do not
    assert served.engine.kvfs.pages_of("tight") == 0
    # Named KV files: the quota is 2; the third name is refused; the program removes what it made
    names = wat('''(module
      (import "symphony" "kv_open" (func $open (param i32 i32 i32) (result i32)))
      (import "symphony" "kv_close" (func $close (param i32) (result i32)))
      (import "symphony" "kv_remove" (func $remove (param i32 i32) (result i32)))
      (import "symphony" "send" (func $send (param i32 i32) (result i32)))
      (memory (export "memory") 1)
      (data (i32.const 16) "abc")
      (func $make (param $at i32) (param $name i32) (local $h i32)
        (local.set $h (call $open (local.get $name) (i32.const 1) (i32.const 1)))
        (i32.store (local.get $at) (local.get $h))
        (if (i32.ge_s (local.get $h) (i32.const 0)) (then (drop (call $close (local.get $h))))))
      (func (export "_start")
        (call $make (i32.const 0) (i32.const 16)) (call $make (i32.const 4) (i32.const 17))
        (call $make (i32.const 8) (i32.const 18))
        (drop (call $remove (i32.const 16) (i32.const 1))) (drop (call $remove (i32.const 17) (i32.const 1)))
        (drop (call $send (i32.const 0) (i32.const 12)))))''')
    made = struct.unpack("<3i", tight.run(tight.upload(names, "names")["sha256"]).output)
    assert made[0] > 0 and made[1] > 0 and made[2] == -12
    assert served.engine.kvfs.session("tight").list() == []


def test_concurrent_uploads_cannot_pass_the_upload_quota_together(served):
    quota = SMALL_QUOTAS["max_upload_bytes"]
    modules = [wat(f'(module (memory (export "memory") 1) (data (i32.const 0) "{"x" * (100 + i)}") '
                   '(func (export "_start")))') for i in range(4)]
    assert all(quota // 3 < len(m) <= quota // 2 for m in modules)  # two fit, not three

    async def upload_all():
        async with AsyncClient(served.url, TOKENS["small"]) as small:
            return await asyncio.gather(*[small.upload(m, "racer") for m in modules], return_exceptions=True)

    results = asyncio.run(upload_all())
    refused = [r for r in results if isinstance(r, ServerError)]
    assert len(refused) == 2 and all(r.status == 403 and "upload quota" in r.reason for r in refused)
    with Client(served.url, TOKENS["small"]) as small:
        assert sum(p["size"] for p in small.programs()) <= quota


def test_a_tenants_uploads_in_progress_hold_at_most_two_modules_of_memory(served):
    """A body is held from its first byte until it is compiled: past two max_upload_bytes of
    one tenant's uploads in progress the next is answered 429 (slow uploads many at a time each
    held up to the cap, with no bound but the host's memory). Another tenant's uploads go on,
    and once the slow ones end the tenant uploads again."""
    module = wat('(module (memory (export "memory") 8) (data (i32.const 0) "' + "x" * 300_000 + '") '
                 '(func (export "_start")))')
    in_progress = served.app.state.symphony.uploading

    async def scenario():
        release = asyncio.Event()

        async def slow_body():
            yield b"\0" * 900_000  # not a module: refused once it ends
            await release.wait()

        async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
            def upload(tenant, body):
                return http.post("/programs", content=body, headers={"authorization": f"Bearer {TOKENS[tenant]}"})

            slow = [asyncio.create_task(upload("alice", slow_body())) for _ in range(2)]
            for _ in range(600):  # until the server holds both first chunks
                if in_progress.get("alice", 0) >= 1_800_000:
                    break
                await asyncio.sleep(0.05)
            refused, other = await upload("alice", module), await upload("bob", module)
            release.set()
            ended = await asyncio.gather(*slow)
            return refused, other, ended, await upload("alice", module)

    refused, other, ended, again = asyncio.run(scenario())
    assert refused.status_code == 429 and "bytes of uploads in progress" in refused.json()["detail"], refused.text
    assert other.status_code == 201 and again.status_code == 201, (other.text, again.text)
    assert [r.status_code for r in ended] == [400, 400]
    assert in_progress["alice"] == 0


def test_a_tenants_slow_compiles_take_one_slot_not_every_one(served, monkeypatch):
    """Uploads compile two at a time; a tenant's queue of modules slow to compile took both
    slots, one after another, and another tenant's upload waited behind all of them. A tenant
    now compiles one at a time, so the other's goes through the free slot. Carol's compiles are
    held until dave's upload is answered: the order does not depend on how fast cranelift is."""
    state = served.app.state.symphony
    compile_program, release = state.store.add, threading.Event()
    held = []  # carol's compiles that started, each held until `release`

    def add(tenant, data, name, quota_bytes):
        if tenant == "carol":
            held.append(name)
            release.wait()
        return compile_program(tenant, data, name, quota_bytes)

    monkeypatch.setattr(state.store, "add", add)
    slow = [wat(f'(module (memory (export "memory") 1) (func (export "_start")) (func (export "carol{i}")))')
            for i in range(4)]  # distinct: none is already compiled
    tiny = wat('(module (memory (export "memory") 1) (func (export "_start")) (func (export "dave") ))')

    async def scenario():
        async with AsyncClient(served.url, TOKENS["carol"]) as carol, AsyncClient(served.url, TOKENS["dave"]) as dave:
            slow_ones = [asyncio.create_task(carol.upload(m, f"slow{i}")) for i, m in enumerate(slow)]
            try:
                # Every body is in (each handler then waits for a slot) and a compile holds one.
                while state.uploading.get("carol", 0) < sum(map(len, slow)) or not held:
                    await asyncio.sleep(0.01)
                # Holding both slots, carol would keep dave waiting until released: a deadlock
                # here, ended by the timeout, which only a failing server reaches.
                stored = await asyncio.wait_for(dave.upload(tiny, "tiny"), 60)
                return stored, list(held)
            finally:
                release.set()
                await asyncio.gather(*slow_ones)

    stored, held_meanwhile = asyncio.run(scenario())
    assert stored["name"] == "tiny" and len(held_meanwhile) == 1, held_meanwhile  # carol compiled one at a time


def test_each_tenant_numbers_its_own_processes(served, clients):
    """pids were one counter for the whole server: a tenant learned from its own pids how many
    processes the others ran. Each tenant's now count 1, 2, 3... by themselves, and the same
    number names another tenant's process or none."""
    bob = clients["bob"]
    echo = bob.upload(ECHO, "echo")["sha256"]
    first = bob.launch(echo, detached=True)["pid"]
    with Client(served.url, TOKENS["carol"]) as carol:
        program = carol.upload(ECHO, "echo")["sha256"]
        for _ in range(3):
            carol.kill(carol.launch(program, detached=True)["pid"])
    second = bob.launch(echo, detached=True)["pid"]
    assert second == first + 1  # carol's three launches in between do not show
    bob.kill(first)
    bob.kill(second)
