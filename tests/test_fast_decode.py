"""The fast decode step (lip/process.py's Process._fast_pred over fiber_native.c's fast call): a
C guest's `pred` of one greedy token continuing its file skips the system-call layer's decoding,
and answers exactly as that layer does; every shape just outside it goes the ordinary way."""
from __future__ import annotations

from pathlib import Path

import pytest

from guests import build_c
from symphony_os.engine import Engine
from symphony_os.errors import ErrorCode as E
from symphony_os.lip import core_abi
from symphony_os.lip.limits import ProcessLimits
from symphony_os.lip.runtime import Runtime

GUEST = Path(__file__).resolve().parent / "c_guests" / "decode_shapes.c"


@pytest.fixture(scope="module")
def engine(stories_path):
    engine = Engine.from_path(stories_path, device="cpu", page_size=16, num_pages=256)
    yield engine
    engine.stop()


def run(engine: Engine, program: Path, args=(), limits=None) -> list[tuple[str, int]]:
    out = []
    with Runtime(engine) as runtime:
        process = runtime.spawn(runtime.load(program), args=list(args), on_output=out.append,
                                **({"limits": limits} if limits else {}))
        assert runtime.wait(process, 120) == 0, (process.end_reason, process.log[-3:])
    return [(label, int(value)) for label, value in
            (line.split("=", 1) for line in b"".join(out).decode().splitlines())]


def test_decode_steps_in_the_common_shape_skip_the_call_layer_and_answer_the_same(engine, tmp_path, monkeypatch):
    ordinary = []
    pred = core_abi.CoreCalls.pred

    def counted(self, mem, kv, ids_ptr, pos_ptr, n, kind, arg, out_ptr, cap):
        ordinary.append((pos_ptr != 0, n, cap, ids_ptr, out_ptr))
        return pred(self, mem, kv, ids_ptr, pos_ptr, n, kind, arg, out_ptr, cap)

    monkeypatch.setattr(core_abi.CoreCalls, "pred", counted)
    ordinary_tickets = []
    for name in ("pred_submit", "pred_wait"):
        def counted_call(self, *args, _name=name, _call=getattr(core_abi.CoreCalls, name)):
            ordinary_tickets.append(_name)
            return _call(self, *args)
        monkeypatch.setattr(core_abi.CoreCalls, name, counted_call)
    answers = run(engine, build_c(GUEST, tmp_path / "decode_shapes.wasm"))

    ids = engine.tokenize("Once upon a time", add_special_tokens=False)
    session = engine.session()
    handle = session.create()
    greedy = [engine.pred(session, handle, ids).token]
    for _ in range(9):
        greedy.append(engine.pred(session, handle, [greedy[-1]]).token)
    after_positions = engine.pred(session, handle, [greedy[-1]], positions=[len(ids) + 9]).token
    session.close_all()
    assert answers == [("prefill", greedy[0]), *(("fast", token) for token in greedy[1:7]),
                       ("fast-buffer", greedy[7]), ("submit-wait", greedy[8]), ("wait-again", E.BAD_HANDLE),
                       ("submit-bad-handle", E.BAD_HANDLE), ("wait-cap-negative", E.INVALID_ARGUMENT),
                       ("wait-after", greedy[9]), ("positions", after_positions),
                       ("cap-negative", E.INVALID_ARGUMENT), ("ids-outside", E.BAD_POINTER),
                       ("buffer-outside", E.BAD_POINTER), ("token-negative", E.INVALID_ARGUMENT),
                       ("token-past-vocab", E.INVALID_ARGUMENT), ("bad-handle", E.BAD_HANDLE), ("after", 1)]
    # The ordinary way: the prefill and the six shapes outside the fast one; not the seven fast
    # steps, the bad handle (the engine refuses it, as for any pred) or the last step.
    assert len(ordinary) == 7 and ordinary[0][1] == len(ids) and ordinary[1][0]
    # pred_submit + pred_wait: the fast pair, but a wait on an ended ticket or with a negative cap.
    assert ordinary_tickets == ["pred_wait", "pred_wait"]


def test_fast_decode_steps_keep_the_kv_page_limit(engine, tmp_path):
    """Under a page limit only a token that fits in the file's last page is taken fast; the step
    that needs a new page past the limit is refused as any pred is."""
    answers = dict(run(engine, build_c(GUEST, tmp_path / "decode_shapes.wasm"), ["until-error"],
                       ProcessLimits(kv_pages=2)))
    prompt = len(engine.tokenize("Once upon a time", add_special_tokens=False))
    assert answers["error"] == E.LIMIT_EXCEEDED
    assert answers["length"] == 2 * engine.pool.page_size and answers["steps"] == 2 * engine.pool.page_size - prompt
