"""A decode step the engine runs before its caller asks for it, so that the host's work between
two forward passes overlaps the device's (issue 29, direction 3; Pie 0.4 stages the next pass
the same way).

A LIP in the decode lane (lip/process.py) almost always answers a sampled token by feeding it
straight back: `pred_submit(kv, [token])`. When its answer is settled, the engine queues that
next step at once (`Engine.speculate`), tentatively: its KV is written into the slot the file's
next token would take, in the file's own last page (pinned), but the file's length does not
change, so nothing the guest can see moves. The batch driver can then launch the next forward
pass before it resumes the guests, and resume them while the device runs it. A guest whose call
is that very step adopts it (`Engine.adopt`: the token becomes the file's, and its answer is the
guest's); any other call drops it (`Engine.abandon`), and the pass's work for it is discarded.
"""
from __future__ import annotations

QUEUED, RUNNING, ADOPTED, DROPPED = range(4)


class Speculation:
    """One tentative decode step (see the module's docstring): its request (whose `future` is
    this object), its state, the pinned page while it runs (-1: none), and once adopted, the
    answer it was adopted by (its `settle(result, error)` gets the step's outcome)."""

    __slots__ = ("request", "state", "page", "answer")

    def __init__(self):
        self.request = None
        self.state = QUEUED
        self.page = -1
        self.answer = None

    def settle(self, result, error: BaseException | None) -> None:
        """The engine's answer: an adopted step's goes to its adopter (a dropped one never
        reaches here)."""
        self.answer.settle(result, error)
