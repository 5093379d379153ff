"""Step records held back from the training loop's thread, and written in batches off its time.

A step record costs tens of microseconds to build, render, write and queue (a pydantic model, its JSON, the
batch fingerprint). On a tiny model's 7 ms step that is most of the 1 % a guard may cost, so the loop's
thread only keeps the step's values (:meth:`HeldSteps.add`), and they become records in a batch:

- **kicked** (:meth:`HeldSteps.kick`): an integration calls it where the loop is about to run a while without
  the GIL (the backward pass: Lightning's ``on_before_backward``, the end of a Hugging Face model's forward).
  A writer thread builds the due batch then, on the other core, while autograd runs in C++; the loop pays
  an ``Event.set``. Once kicks come, the loop's thread writes only what they leave behind for ``STALE_S``.
- **not kicked** (a loop of your own that never calls it): on the loop's thread, every ``HOLD_S`` or
  ``HOLD_MAX`` records, as one batch (one write, one hand-over to the bus).

Either way a batch written wakes the bus client (``after_batch``): its records, and a read of the
directives, go out at once, not at the client's next poll.

:meth:`HeldSteps.drain` writes everything held at once: the session calls it before anything else reaches
the step log (a marker, a directive applied, an eval, a checkpoint, close), so records stay in step order,
and a rollback's ``skip_after`` finds the ids of every step trained. A process killed outright loses at
most the records of the last ``HOLD_S`` (``KICK_DUE_S`` when kicked, ``STALE_S`` when kicks stopped coming).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

HOLD_S = 0.1  # not kicked: the loop writes its held records at most this long after their step...
HOLD_MAX = 64  # ...or once this many are held
KICK_DUE_S = 0.25  # kicked: a batch is due this long after its first record. A batch pays a fixed cost (the
# writer's caches are cold: the loop's thread evicted them): on the tiny model's 8 ms step the writer spent
# 62 us a record in batches of 0.08 s, 28 us in batches of 0.25 s (docs/integrate.md, Cost)
STALE_S = 1.0  # kicked: what the kicks leave held this long is written by the loop's thread after all


class HeldSteps:
    """Held step values (any tuples) and the writer that turns them into records (see the module docstring).

    ``write_batch(items)`` builds, writes and queues a batch (called with the lock held, on either thread);
    ``after_batch()`` runs after every batch written, on the thread that wrote it (the session wakes the bus
    client: the records go out now, while a kicked batch's backward pass still runs)."""

    def __init__(self, write_batch: Callable[[list[tuple]], None], after_batch: Callable[[], None] | None = None):
        self._write_batch, self._after_batch = write_batch, after_batch
        self._held: deque[tuple] = deque()  # append / popleft are atomic: the loop adds without the lock
        self._since = 0.0  # when the oldest held item was added
        self._lock = threading.Lock()  # one batch at a time, so records reach the log in order
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._error: BaseException | None = None  # a kicked batch's failure, raised on the loop's thread
        self.kicked = False

    def add(self, item: tuple, now: float) -> None:
        """Hold one step's values (the loop's thread)."""
        held = self._held
        if not held:
            self._since = now
        held.append(item)
        if self._error is not None:  # a kicked batch failed: raised here, this step's values held all the same
            self._raise_error()
        if self.kicked:  # the writer takes them at the next kick; the loop only if kicks stopped coming
            if now - self._since >= STALE_S or len(held) >= 4 * HOLD_MAX:
                self.drain()
        elif now - self._since >= HOLD_S or len(held) >= HOLD_MAX:
            self.drain()

    def kick(self) -> None:
        """The loop is about to run without the GIL for a while: write a due batch now, on the writer thread."""
        self.kicked = True  # the loop kicks: its own thread leaves the batches to the writer (STALE_S, not HOLD_S)
        if not self._held or (len(self._held) < HOLD_MAX and time.time() - self._since < KICK_DUE_S):
            return
        if self._thread is None:
            if self._closing:
                return
            self._thread = threading.Thread(target=self._run, name="sentinel-steps", daemon=True)
            self._thread.start()
        self._wake.set()

    def drain(self) -> None:
        """Write everything held, now, on the calling thread (waits for a batch the writer is writing)."""
        self._write_all()
        self._raise_error()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the writer thread and write what is left (the loop's thread)."""
        self._closing = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join(timeout)
            self._thread = None
        self.drain()

    def _run(self) -> None:
        while True:
            self._wake.wait(STALE_S)
            self._wake.clear()
            if self._closing:
                return
            try:
                self._write_all()
            except BaseException as e:  # noqa: BLE001 - handed to the loop's thread: raised at its next add
                self._error = e

    def _write_all(self) -> None:
        with self._lock:
            items = []
            while self._held:
                items.append(self._held.popleft())
            if not items:
                return
            self._write_batch(items)
        if self._after_batch is not None:
            self._after_batch()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err
