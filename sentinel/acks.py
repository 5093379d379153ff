"""Directives sent by hand (``sentinel rollback``, ``pause``, ``skip-list add``): where waiting for
the trainer's ack starts, and the wait itself (only an ack the trainer signed counts)."""

from __future__ import annotations

import time

from sentinel import bus


def last_ack_id(ref) -> str:
    """The acks stream's newest entry id, where waiting for an ack starts: an entry stamped far
    ahead (anyone can XADD one) does not count, or no ack after it would ever be read."""
    with bus.bus_errors(ref.r):
        last = ref.r.xrevrange(ref.keys.acks, count=16)
    return next((eid for eid, _ in last if not bus.is_future_id(eid)), "0-0")


def wait_ack(ref, directive_id: str, after_id: str, timeout: float, on_tick=None, *,
             secret: bytes | None = None, entry_id: str | None = None):
    """Block until the trainer acks ``directive_id`` (returns the ``Ack``) or ``timeout`` passes (None).

    With ``secret``, only acks the trainer signed count (anyone can XADD an "applied"); with
    ``entry_id`` (the directive's own stream entry), a refusal of another entry under the same
    directive id (a forged copy) is not the answer."""
    from sentinel.ingest import check_ack
    from sentinel.protocol import Ack, SchemaError

    t0 = time.monotonic()
    cursor = after_id
    while True:
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            return None
        if on_tick:
            on_tick(time.monotonic() - t0)
        with bus.bus_errors(ref.r):
            resp = ref.r.xread({ref.keys.acks: cursor}, count=100, block=max(1, int(min(0.5, left) * 1000)))
        for _, items in resp or []:
            for eid, fields in items:
                if bus.is_future_id(eid):
                    continue  # never the cursor: nothing after it would be read
                cursor = eid
                if secret is not None:
                    a = check_ack(bus.to_entry(ref.keys.acks, eid, fields), ref.run, secret).record
                else:
                    try:
                        a = Ack.from_json((fields or {}).get(bus.FIELD, "{}"))
                    except SchemaError:
                        continue
                if a is None or a.directive_id != directive_id:
                    continue
                if entry_id is not None and a.entry_id is not None and a.entry_id != entry_id:
                    continue
                return a
