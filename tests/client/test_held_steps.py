"""HeldSteps: a loop's step values become records in batches, in order, on the loop's thread or (kicked) on a
writer thread, and nothing held is lost at drain, close or a failed batch."""

from __future__ import annotations

import threading
import time

import pytest

from sentinel.client.held_steps import HOLD_MAX, HOLD_S, KICK_DUE_S, STALE_S, HeldSteps


class Sink:
    def __init__(self, fail_on: int | None = None):
        self.batches: list[tuple[str, list[int]]] = []  # (thread name, items)
        self.woken = 0
        self.fail_on = fail_on
        self.written = threading.Event()

    def write(self, items):
        if self.fail_on is not None and self.fail_on in [i[0] for i in items]:
            raise ValueError(f"bad step {self.fail_on}")
        self.batches.append((threading.current_thread().name, [i[0] for i in items]))
        self.written.set()

    def after_batch(self):
        self.woken += 1

    @property
    def steps(self) -> list[int]:
        return [s for _, b in self.batches for s in b]


def _add(held: HeldSteps, steps, t0: float, dt: float = 0.0):
    for i, s in enumerate(steps):
        held.add((s,), t0 + i * dt)


@pytest.mark.parametrize(("n", "dt", "batches"), [
    (HOLD_MAX - 1, 0.0, 0),  # fewer than HOLD_MAX, all at once: held
    (HOLD_MAX, 0.0, 1),  # HOLD_MAX: one batch of all of them
    (3, HOLD_S / 2 + 1e-6, 1),  # the third is HOLD_S after the first: one batch
], ids=["under-max", "at-max", "age"])
def test_without_kicks_the_loop_writes_a_batch_when_due(n, dt, batches):
    sink = Sink()
    held = HeldSteps(sink.write, sink.after_batch)
    _add(held, range(n), time.time(), dt)
    assert len(sink.batches) == batches
    assert all(name == threading.current_thread().name for name, _ in sink.batches)
    held.close()
    assert sink.steps == list(range(n)), "close writes the rest, in order"
    assert sink.woken == len(sink.batches) > 0, "every batch written on the loop's thread wakes the bus too"


def test_a_kick_writes_the_due_batch_on_the_writer_thread_and_wakes_the_bus():
    sink = Sink()
    held = HeldSteps(sink.write, sink.after_batch)
    now = time.time()
    _add(held, range(5), now)
    held.kick()  # not due yet (KICK_DUE_S): no thread yet, but the loop's thread now leaves batches to kicks
    assert held._thread is None and held.kicked
    held.add((5,), now + HOLD_S)  # HOLD_S after the first: no longer written on the loop's thread
    assert sink.batches == []
    _add(held, range(6, 8), now)
    held._since = now - KICK_DUE_S  # the held batch's first record is now older than KICK_DUE_S
    held.kick()
    assert sink.written.wait(5), "the writer thread wrote the batch"
    deadline = time.time() + 5
    while sink.woken == 0 and time.time() < deadline:
        time.sleep(0.001)
    assert sink.batches == [("sentinel-steps", list(range(8)))]
    assert sink.woken == 1
    # kicked: the loop's thread no longer writes at HOLD_MAX, only when kicks stop coming (4x, or STALE_S)
    _add(held, range(8, 8 + HOLD_MAX), time.time())
    assert len(sink.batches) == 1
    held.add((999,), time.time() + STALE_S)
    assert sink.batches[-1][0] == threading.current_thread().name and sink.steps[-1] == 999
    held.close()
    assert sink.steps == [*range(8 + HOLD_MAX), 999]


def test_drain_writes_everything_held_in_order_after_a_batch_in_flight():
    order: list[int] = []
    gate = threading.Event()

    def slow_write(items):  # the writer thread's batch is still being written when the loop drains
        if threading.current_thread().name == "sentinel-steps":
            gate.wait(5)
        order.extend(i[0] for i in items)

    held = HeldSteps(slow_write)
    _add(held, range(3), time.time() - 1)
    held._since = time.time() - 1
    held.kick()
    time.sleep(0.05)
    _add(held, range(3, 6), time.time())
    threading.Timer(0.1, gate.set).start()
    held.drain()  # waits for the writer's batch, then writes the rest
    assert order == list(range(6))
    held.close()


def test_a_failed_kicked_batch_is_raised_on_the_loops_thread():
    sink = Sink(fail_on=2)
    held = HeldSteps(sink.write, sink.after_batch)
    _add(held, range(4), time.time() - 1)
    held._since = time.time() - 1
    held.kick()
    deadline = time.time() + 5
    while held._error is None and time.time() < deadline:
        time.sleep(0.001)
    with pytest.raises(ValueError, match="bad step 2"):
        held.add((4,), time.time())
    held.close()
    assert sink.steps == [4], "the loop goes on after the error is raised"
