"""Thin stream helpers over a connected client: publish (MACed), read, read as a group, ack,
autoclaim, decode into the contract's records, and the run registry.

Every stream entry carries the record JSON under the single field ``json`` (``FIELD``); Redis
exceptions are translated into ``BusError`` (``bus_connect.bus_errors``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import redis

from sentinel.bus_connect import _describe, bus_errors, translate
from sentinel.bus_url import FIELD, BusError
from sentinel.contract.keys import Keys
from sentinel.contract.parsing import SchemaError
from sentinel.contract.records import Ack, Directive, Event, StepRecord, TimelineRecord, parse_step_line
from sentinel.contract.signing import RECORD_MAC_FIELD, record_mac


class Entry(NamedTuple):
    """One stream entry: the stream key, the entry id, and its fields (``{"json": ...}``).

    ``bad`` is set (to a ``REJECT_REASONS`` value, e.g. ``"not_utf8"``) when the entry could not
    even be decoded; ``fields`` is then empty. Such an entry must still be acknowledged.
    """

    stream: str
    id: str
    fields: dict[str, str]
    bad: str | None = None


def raw(r: redis.Redis) -> redis.Redis:
    """A client on the same server that returns ``bytes`` (cached on ``r``).

    Untrusted streams are read through it: with ``decode_responses=True`` one non-UTF-8 byte in
    any entry makes redis-py raise while parsing the *whole* reply, so a single hostile entry
    would block every entry behind it, forever. Raw replies are decoded entry by entry instead.
    """
    if not r.connection_pool.connection_kwargs.get("decode_responses"):
        return r
    cached = getattr(r, "_sentinel_raw", None)
    if cached is None:
        pool = r.connection_pool
        kwargs = {**pool.connection_kwargs, "decode_responses": False}
        cached = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))
        r._sentinel_raw = cached  # type: ignore[attr-defined]
    return cached


def _group_reader(r: redis.Redis) -> redis.Redis:
    """``raw(r)``'s twin on the same connections, whose XREADGROUP replies come back as Redis sent
    them (RESP2 lists, cached on ``raw(r)``). ``read_group`` decodes them itself, entry by entry and
    in one pass: redis-py's reply callback builds a dict of bytes per entry that ``to_entry`` then
    built again as text, and the two were about a tenth of a daemon's CPU at 300 runs
    (``bench/probes/daemon_cpu.py``)."""
    rr = raw(r)
    cached = getattr(rr, "_sentinel_group_reader", None)
    if cached is None:
        cached = redis.Redis(connection_pool=rr.connection_pool)
        cached.response_callbacks.pop("XREADGROUP", None)
        rr._sentinel_group_reader = cached  # type: ignore[attr-defined]
    return cached


def _group_entries(resp) -> list[Entry]:
    """The entries of a raw RESP2 XREADGROUP reply (``[[stream, [[id, [field, value, ...]], ...]], ...]``;
    None when the read timed out), as ``entries`` decodes them. An entry deleted while pending
    (no fields) is left out; a field name or value that is not UTF-8 marks its entry ``bad``."""
    out: list[Entry] = []
    for stream, items in resp or ():
        s = _text(stream)  # stream names and ids are ASCII by construction
        for eid, flat in items:
            if flat is None:
                continue
            i = _text(eid)
            it = iter(flat)
            try:
                out.append(Entry(s, i, {_text(k): _text(v) for k, v in zip(it, it)}))
            except UnicodeDecodeError:
                out.append(Entry(s, i, {}, "not_utf8"))
    return out


def _text(b: bytes | str) -> str:
    return b if isinstance(b, str) else b.decode("utf-8")


def to_entry(stream: bytes | str, eid: bytes | str, fields: dict | None) -> Entry:
    """Decode one raw entry; a field name or value that is not UTF-8 marks it ``bad``."""
    s, i = _text(stream), _text(eid)  # stream names and ids are ASCII by construction
    try:
        return Entry(s, i, {_text(k): _text(v) for k, v in (fields or {}).items()})
    except UnicodeDecodeError:
        return Entry(s, i, {}, "not_utf8")


def ensure_group(r: redis.Redis, stream: str, group: str, start_id: str = "0") -> bool:
    """Create consumer group ``group`` on ``stream`` (creating the stream too). Idempotent.

    Returns True when it created the group. Only the BUSYGROUP reply (group already exists) is
    swallowed; anything else (wrong key type, ACL, connection) is a ``BusError``.
    """
    try:
        r.xgroup_create(stream, group, id=start_id, mkstream=True)
        return True
    except redis.ResponseError as e:
        if str(e).startswith("BUSYGROUP"):
            return False
        raise translate(e, _describe(r)) from None
    except redis.RedisError as e:
        raise translate(e, _describe(r)) from None


def _clamp_block(r: redis.Redis, block_ms: int | None) -> int | None:
    """Keep a blocking read shorter than the socket timeout, or redis-py reports a timeout error."""
    if block_ms is None:
        return None
    sock_t = r.connection_pool.connection_kwargs.get("socket_timeout")
    if sock_t:
        block_ms = min(int(block_ms), max(1, int(sock_t * 1000 * 0.8)))
    return max(0, int(block_ms)) or 1  # BLOCK 0 would mean "forever"


def entries(resp) -> list[Entry]:
    out: list[Entry] = []
    # connect() speaks RESP2: [[stream, [(id, fields), ...]], ...]
    for stream, items in resp or []:
        for eid, fields in items:
            if fields is None:  # entry deleted (trimmed) while pending
                continue
            out.append(to_entry(stream, eid, fields))
    return out


def read_stream(r: redis.Redis, stream: str, after_id: str, *, count: int = 1000) -> list[Entry]:
    """XREAD entries after ``after_id`` (no group), decoded entry by entry like ``read_group``."""
    with bus_errors(r):
        return entries(raw(r).xread({stream: after_id}, count=count))


def read_group(
    r: redis.Redis,
    streams: str | Sequence[str],
    group: str,
    consumer: str,
    *,
    count: int = 100,
    block_ms: int | None = None,
    pending: bool = False,
) -> list[Entry]:
    """XREADGROUP on one or more streams; returns entries in stream order.

    ``pending=True`` re-reads this consumer's own delivered-but-unacked entries (id ``0``): do that
    once at start so a daemon that crashed mid-batch processes them again. If a group vanished
    (Redis restarted without persistence) it is recreated and the read retried once.
    ``block_ms`` is capped below the connection's socket timeout.
    """
    names = [streams] if isinstance(streams, str) else list(streams)
    block = _clamp_block(r, block_ms)
    # the arguments as redis-py's xreadgroup would send them, with its reply parsing left out (``_group_reader``)
    args = ["GROUP", group, consumer, "COUNT", int(count)] + (["BLOCK", block] if block is not None else [])
    args += ["STREAMS", *names, *(["0" if pending else ">"] * len(names))]
    for attempt in (0, 1):
        try:
            return _group_entries(_group_reader(r).execute_command("XREADGROUP", *args))
        except redis.ResponseError as e:
            if str(e).startswith("NOGROUP") and attempt == 0:
                for s in names:
                    ensure_group(r, s, group)
                continue
            raise translate(e, _describe(r)) from None
        except redis.RedisError as e:
            raise translate(e, _describe(r)) from None
    return []  # pragma: no cover


# XREADGROUP ... STREAMS KEYS[1..n] > ..., and for each stream that had entries an HGETALL of the hash paired
# with it (KEYS[n + i]): one call. Errors come back in place (pcall); one from the read itself, whole
_READ_WITH_HASHES = """
local n = tonumber(ARGV[4])
local args, pos = {'XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', ARGV[3], 'STREAMS'}, {}
for i = 1, n do args[7 + i] = KEYS[i]; args[7 + n + i] = '>'; pos[KEYS[i]] = i end
local got = redis.pcall(unpack(args))
if type(got) == 'table' and got['err'] then return got end
local hashes = {}
for k, s in ipairs(got or {}) do hashes[k] = redis.pcall('HGETALL', KEYS[n + pos[s[1]]]) end
return {got, hashes}
"""


_READ_WITH_HASHES_SHA = hashlib.sha1(_READ_WITH_HASHES.encode()).hexdigest()
SCRIPT_RETRY_S = 60.0  # a server that refused the script (an ACL without EVAL, scripting off) is asked again after this


def read_group_with_hashes(r: redis.Redis, streams: Sequence[str], hashes: Sequence[str], group: str, consumer: str,
                           *, count: int = 100) -> tuple[list[Entry], dict[str, Any]] | None:
    """``read_group`` without blocking, and with it, in the same round trip, the HGETALL of the hash
    paired with each stream that had new entries (``hashes[i]`` with ``streams[i]``): (the entries, a
    dict stream -> the hash as ``{field: value}`` in bytes, or the ``ResponseError`` its key gave).

    A daemon reads every run's checkpoints hash before it judges the run's records (a checkpoint
    registered before a record is known when that record is judged); asked in a second round trip,
    that waited on Redis once more per iteration. EVALSHA, and EVAL where the server does not have
    the script yet (which caches it: the ACL of docs/deploy.md allows both, not SCRIPT LOAD). None
    when the server refused the read as a whole: a group that vanished or a key of another type
    (``read_group`` then reads, and says what was wrong), or the script itself (an ACL without EVAL,
    scripting turned off: then None without asking for ``SCRIPT_RETRY_S``)."""
    reader = _group_reader(r)
    if getattr(reader, "_sentinel_no_script_until", 0.0) > time.monotonic():
        return None
    names = list(streams)
    keys = names + list(hashes)
    args = (len(keys), *keys, group, consumer, int(count), len(names))
    try:
        try:
            reply = reader.execute_command("EVALSHA", _READ_WITH_HASHES_SHA, *args)
        except redis.exceptions.NoScriptError:  # not cached there yet (a new or restarted server): EVAL caches it
            reply = reader.execute_command("EVAL", _READ_WITH_HASHES, *args)
    except redis.ResponseError as e:
        if not str(e).startswith(("NOGROUP", "WRONGTYPE")):  # the read's own refusals come back as they are
            reader._sentinel_no_script_until = time.monotonic() + SCRIPT_RETRY_S  # type: ignore[attr-defined]
        return None
    except redis.RedisError as e:
        raise translate(e, _describe(r)) from None
    got, replies = reply
    out: dict[str, Any] = {}
    for (stream, _items), h in zip(got or (), replies):
        out[_text(stream)] = dict(zip(h[::2], h[1::2])) if isinstance(h, list) else h
    return _group_entries(got), out


def ack(r: redis.Redis, stream: str, group: str, *ids: str) -> int:
    """XACK entries once they are fully processed (at-least-once delivery)."""
    if not ids:
        return 0
    with bus_errors(r):
        return int(r.xack(stream, group, *ids))


def autoclaim(
    r: redis.Redis,
    stream: str,
    group: str,
    consumer: str,
    *,
    min_idle_ms: int,
    start_id: str = "0-0",
    count: int = 100,
) -> tuple[str, list[Entry]]:
    """XAUTOCLAIM entries another consumer left pending for ``min_idle_ms`` (it died).

    Returns ``(next_start_id, entries)``; ``next_start_id == "0-0"`` means the scan is complete.
    Entries trimmed from the stream while pending are dropped (Redis 6.2 returns them with no
    fields; Redis >= 7 removes them and lists them separately).
    """
    with bus_errors(r):
        resp = raw(r).xautoclaim(stream, group, consumer, min_idle_time=min_idle_ms, start_id=start_id, count=count)
    next_id, items = _text(resp[0]), resp[1]
    return next_id, [to_entry(stream, eid, f) for eid, f in items if f is not None]


def _to_json(record: Any) -> str:
    if hasattr(record, "to_json"):
        return record.to_json()
    if isinstance(record, (str, bytes)):
        return record.decode() if isinstance(record, bytes) else record
    return json.dumps(record, separators=(",", ":"), allow_nan=True)


def publish(r: redis.Redis, stream: str, record: Any, maxlen: int | None = 100_000, *, secret: bytes | None = None) -> str:
    """XADD ``record`` (a protocol model, dict or JSON text) under field ``json``; returns its id.

    ``maxlen`` trims approximately (``~``), which is O(1) amortised; ``None`` keeps everything.
    With ``secret`` the entry also carries ``mac`` (``protocol.record_mac``): step records and
    acks must, or the sentinel refuses them.
    """
    data = _to_json(record)
    fields = {FIELD: data}
    if secret is not None:
        fields[RECORD_MAC_FIELD] = record_mac(secret, stream, data)
    with bus_errors(r):
        return r.xadd(stream, fields, maxlen=maxlen, approximate=True)


# Every entry id stamped more than a day ahead of the server's clock goes, by copying the rest to a
# new key that replaces the stream (valkey >= 8 will not lower a stream's last id by XSETID once an
# entry above it was deleted). Consumer groups go with the old key: their readers recreate them.
_REPAIR_IDS = """
local t = redis.call('TIME')
local bound = string.format('%d', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1]))
local keep = redis.call('XRANGE', KEYS[1], '-', bound)
local n = redis.call('XLEN', KEYS[1])
if #keep == n then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  local last = ''
  for i = 1, #info, 2 do if info[i] == 'last-generated-id' then last = info[i + 1] end end
  if (tonumber(string.match(last, '^(%d+)-')) or 0) <= tonumber(bound) then return -1 end
end
redis.call('DEL', KEYS[2])
for _, e in ipairs(keep) do redis.call('XADD', KEYS[2], e[1], unpack(e[2])) end
if #keep == 0 then redis.call('DEL', KEYS[1]) else redis.call('RENAME', KEYS[2], KEYS[1]) end
return n - #keep
"""
FUTURE_ID_MS = 86_400_000  # an entry id further ahead of the server's clock than this is hostile


def id_exhausted(e: BaseException) -> bool:
    """True for the XADD refusal a stream gets once an entry with a far-future (or the largest) id is in it."""
    text = str(e)
    return "exhausted the last possible ID" in text or "equal or smaller than the target stream top item" in text


def repair_stream_ids(r: redis.Redis, stream: str) -> int:
    """Drop the entries of ``stream`` whose ids are stamped more than a day ahead (anyone with
    bus access can XADD ``18446744073709551615-18446744073709551615``, after which no writer can
    add to the stream, ever). Returns how many went, or -1 when the stream needed no repair."""
    with bus_errors(r):
        return int(r.eval(_REPAIR_IDS, 2, stream, stream + ":repair", FUTURE_ID_MS))


def future_after_ms(now: float | None = None) -> float:
    """The millisecond stamp beyond which an entry id is stamped too far ahead of ``now`` (this
    machine's clock): ``is_future_id``'s bound, for a reader that has the id's number already."""
    return (time.time() if now is None else now) * 1000 + FUTURE_ID_MS


def is_future_id(eid: str, now: float | None = None) -> bool:
    """An entry id stamped more than a day ahead of ``now`` (this machine's clock)."""
    ms, _, _ = eid.partition("-")
    return len(ms) > 15 or (ms.isdigit() and int(ms) > future_after_ms(now))


def publish_own(r: redis.Redis, stream: str, record: Any, maxlen: int | None = 100_000) -> str:
    """``publish`` to a stream only the sentinel's side writes (directives, approvals, events),
    through what anyone with bus access can do to it: a key of another Redis type there is
    replaced, and entries stamped far ahead (which refuse every XADD after them) are removed."""
    try:
        return publish(r, stream, record, maxlen)
    except BusError as e:
        if "WRONGTYPE" in str(e):
            with bus_errors(r):
                r.delete(stream)
        elif id_exhausted(e):
            repair_stream_ids(r, stream)
        else:
            raise
    return publish(r, stream, record, maxlen)


_BY_SUFFIX = {":directives": Directive, ":acks": Ack, ":events": Event}


def decode(entry: Entry | tuple | dict, model: type | None = None):
    """Parse a stream entry back into its protocol record.

    Accepts an ``Entry``, an ``(id, fields)`` pair or the fields dict. Without ``model`` the type
    follows from the stream name (``Keys(run).steps`` -> ``StepRecord``/``TimelineRecord``,
    ``.directives`` -> ``Directive``, ``.acks`` -> ``Ack``, ``.events`` -> ``Event``).
    Raises ``SchemaError`` for an entry without a ``json`` field or with an invalid record.
    """
    stream = None
    if isinstance(entry, Entry):
        if entry.bad:
            raise SchemaError(f"stream entry {entry.id} could not be decoded ({entry.bad})", entry.bad)
        stream, fields = entry.stream, entry.fields
    elif isinstance(entry, dict):
        fields = entry
    else:
        fields = entry[-1]
    data = (fields or {}).get(FIELD)
    if data is None and fields:
        data = fields.get(FIELD.encode())  # a client without decode_responses
    if data is None:
        eid = entry.id if isinstance(entry, Entry) else (entry[0] if isinstance(entry, tuple) else "?")
        raise SchemaError(f"stream entry {eid} has no '{FIELD}' field")
    if model is None and stream is not None:
        for suffix, m in _BY_SUFFIX.items():
            if stream.endswith(suffix):
                model = m
                break
    if model is None or model in (StepRecord, TimelineRecord):
        return parse_step_line(data)
    return model.from_json(data)


# --------------------------------------------------------------------------------------------
# Run registry
# --------------------------------------------------------------------------------------------


def register_run(r: redis.Redis, run: str, info: dict[str, Any]) -> None:
    """Add ``run`` to ``Keys.RUNS`` and write its metadata hash ``Keys(run).info``.

    Non-string values are stored as JSON so that readers can ``json.loads`` them back.
    """
    keys = Keys(run)
    mapping = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in info.items()}
    with bus_errors(r):
        pipe = r.pipeline(transaction=True)
        pipe.sadd(Keys.RUNS, run)
        if mapping:
            pipe.hset(keys.info, mapping=mapping)
        pipe.execute()


def list_runs(r: redis.Redis) -> list[str]:
    """The registered run ids, sorted. Members that are not valid run ids (not UTF-8, spaces,
    colons: anyone with bus access can SADD) are left out, so they cannot stop discovery."""
    with bus_errors(r):
        members = raw(r).smembers(Keys.RUNS)
    out = []
    for m in members:
        try:
            run = _text(m)
            Keys(run)
        except (UnicodeDecodeError, ValueError):
            continue
        out.append(run)
    return sorted(out)
