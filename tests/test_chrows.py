"""The team store's TabSeparated rows (issue 24 item 5): the column-at-a-time encoder agrees
with its record-by-record definition, and what lands in a real ClickHouse is what the
JSONEachRow encoder before it stored, value for value (NaN, infinities, -0.0, the
smallest and largest floats, ints past 2**53, booleans, text with tabs, newlines,
backslashes, NUL and non-ASCII), both tables.
"""

from __future__ import annotations

import math
import random
import struct
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expr_tracker.backends.base import Identity
from expr_tracker.backends.chrows import Encoder
from expr_tracker.backends.clickhouse import ClickHouseBackend, schema
from tests.chserver import ClickHouse

# one worker runs every ClickHouse test, in turn (make test runs 4 workers)
pytestmark = pytest.mark.xdist_group("clickhouse")

TEXTS = ["", "plain", "a\tb", "line\nnext", "back\\slash", "\\t not a tab", "quote\"'",
         "nul\x00x", "cr\rlf", "ünïcødé ✓ 日本", "\x01\x1f ctl", "NaN", "inf", "\\N"]
FLOATS = [0.0, -0.0, 0.1, 1 / 3, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
          -1.7976931348623157e308, 1e16, 1e-7, 123456789.12345679, 2.0**53 + 2, math.pi,
          math.nan, math.inf, -math.inf]
INTS = [0, 1, -1, 2**53 + 1, 2**63 - 1, -(2**63), 10**18 + 7]


# the encoder before (a73f360's `ClickHouseBackend.rows`, JSONEachRow): the reference
def _old_value(value: Any) -> tuple[Any, str] | None:
    cls = value.__class__
    if cls is float:
        if value - value == 0.0:
            return value, ""
        return ("nan" if value != value else "inf" if value > 0 else "-inf"), ""
    if cls is int:
        return float(value), ""
    if cls is bool:
        return (1.0, "true") if value else (0.0, "false")
    if cls is str:
        return "nan", value
    return None


def _old_rows(ident: Identity, events: Sequence[Mapping[str, Any]]) -> tuple[list[bytes], list[bytes]]:
    metrics: list[bytes] = []
    ranks: list[bytes] = []
    dumps = orjson.dumps
    head = dumps({"project": ident.project, "name": ident.name, "stream": ident.stream or ""})[:-1]
    for ev in events:
        kind = ev.get("_kind")
        if kind is not None and kind != "rank":
            continue
        when = ev.get("_time")
        when = float(when) if isinstance(when, (int, float)) else 0.0
        step, rank, eid = ev.get("_step"), ev.get("_rank"), ev.get("_id")
        shared = b'%b,"rank":%d,"step":%d,"time":%b,"event_id":%b' % (
            head, rank if type(rank) is int and rank >= 0 else ident.rank,
            step if type(step) is int else 0, dumps(when),
            dumps(eid) if eid.__class__ is str else b'""')
        out = metrics
        if kind == "rank":
            out = ranks
            world, local, weight = ev.get("_world_size"), ev.get("_local_rank"), ev.get("_weight")
            shared += b',"world_size":%d,"local_rank":%b,"weight":%b' % (
                world if type(world) is int else ident.world_size or 0,
                b"%d" % local if type(local) is int else b"null",
                dumps(float(weight)) if isinstance(weight, (int, float)) else b"1.0")
        shared += b',"key":'
        for key, raw in ev.items():
            if key[:1] == "_":
                continue
            got = _old_value(raw)
            if got is not None:
                out.append(b'%b%b,"value":%b,"text":%b}' % (
                    shared, dumps(key), dumps(got[0]), dumps(got[1])))
    return metrics, ranks


def _events(seed: int, n: int = 60) -> list[dict[str, Any]]:
    """Step rows and rank records: runs of one shape (the column path) with every odd
    value, and records of their own shape (the record-by-record path)."""
    rnd = random.Random(seed)
    values: list[Any] = [*FLOATS, *INTS, True, False, *TEXTS]
    out: list[dict[str, Any]] = []
    for i in range(n):
        seq = i + 1
        base = {"_step": i, "_time": 1764638000.0 + i / 7, "_seq": seq, "_id": f"ab12cd:{seq}"}
        if i % 10 < 4:  # a run of numbers only: the column path, floats and ints
            ev = {**base, "loss": rnd.choice(FLOATS[:13]), "k": rnd.choice(INTS),
                  "tab\tkey/ü": rnd.random()}
        elif i % 10 < 6:  # the same shape, any value: per value where a column is odd
            ev = {**base, "loss": rnd.choice(values), "k": rnd.choice(values),
                  "tab\tkey/ü": rnd.choice(values)}
        elif i % 10 < 8:  # rank records
            ev = {"_kind": "rank", **base, "_rank": i % 4, "_world_size": 4,
                  "_local_rank": rnd.choice([None, i % 2]), "_weight": rnd.choice([1.0, 2.5, 3]),
                  "step_time": rnd.choice([*FLOATS, *INTS])}
        else:  # a shape of its own, some odd shared columns
            ev = {**base, f"only{i}": rnd.choice(values), "_rank": rnd.choice([0, 2, -1])}
            if i % 3 == 0:
                ev["_step"] = True
        out.append(ev)
    return out


def _lines(pieces: list[bytes]) -> list[bytes]:
    """The lines of a body given as pieces of whole lines, sorted (rows have no order)."""
    body = b"".join(pieces)
    assert body == b"" or body.endswith(b"\n")
    return sorted(body.splitlines())


IDENT = Identity("proj-x", "run.1_a", stream="eval", rank=3, world_size=4, session="ab12cd")


def test_the_column_path_writes_what_the_record_by_record_path_writes() -> None:
    for seed in range(20):
        events = _events(seed)
        enc = Encoder(IDENT.project, IDENT.name, IDENT.stream or "", IDENT.rank, 4)
        metrics, ranks, latest = enc.rows(events)
        slow_m: list[bytes] = []
        slow_r: list[bytes] = []
        assert enc._slow(events, slow_m, slow_r) == latest
        assert _lines(metrics) == _lines(slow_m) and _lines(ranks) == _lines(slow_r)
        assert len(_lines(metrics) + _lines(ranks)) == sum(
            1 for ev in events for k in ev if k[0] != "_")
        assert len(metrics) < len(slow_m)  # the column path wrote some of them


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.fixed_dictionaries(
    {"_step": st.one_of(st.integers(0, 2**53), st.booleans()),
     "_time": st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(0, 2**40)),
     "_id": st.from_regex(r"[a-f0-9]{4}:[0-9]{1,5}", fullmatch=True),
     "a": st.one_of(st.floats(), st.integers(-(2**63), 2**63 - 1), st.booleans(), st.text()),
     "b": st.floats()},
    optional={"_rank": st.integers(-1, 9)}), min_size=1, max_size=12))
def test_any_batch_agrees_with_the_definition(events: list[dict[str, Any]]) -> None:
    enc = Encoder("p", "n", "", 1, 2)
    metrics, ranks, latest = enc.rows(events)
    slow_m: list[bytes] = []
    slow_r: list[bytes] = []
    assert enc._slow(events, slow_m, slow_r) == latest
    assert _lines(metrics) == _lines(slow_m) and ranks == slow_r == []


# -- a real server: the new rows land as the old ones did ----------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouse]:
    ch = ClickHouse(tmp_path_factory.mktemp("clickhouse"))
    ch.start()
    try:
        yield ch
    finally:
        ch.stop()


def backend_rows(events: list[dict[str, Any]]) -> tuple[list[bytes], list[bytes]]:
    enc = Encoder(IDENT.project, IDENT.name, IDENT.stream or "", IDENT.rank, 4)
    metrics, ranks, _ = enc.rows(events)
    return metrics, ranks


def _post(ch: ClickHouse, sql: str, body: bytes) -> None:
    url = ch.url + "/?" + urllib.parse.urlencode({"query": sql})
    with urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=30):
        pass


def _stored(ch: ClickHouse, db: str, table: str) -> list[str]:
    """Every row of `table`, floats by their bits (nan, -0.0 and the last digit told apart)."""
    extra = "world_size, local_rank, hex(reinterpretAsString(weight)), " if table == "rank_metrics" else ""
    return ch.query(
        f"SELECT project, name, stream, rank, step, hex(reinterpretAsString(time)), event_id, {extra}"
        f"key, hex(reinterpretAsString(value)), isNaN(value), text FROM `{db}`.{table} "
        "ORDER BY event_id, key FORMAT TabSeparated").splitlines()


def test_what_lands_in_clickhouse_is_what_the_jsoneachrow_encoder_stored(
        server: ClickHouse, tmp_path: Path) -> None:
    events = _events(7, 200)
    old, new = "rows_old", "rows_new"
    for statement in schema(old):
        server.query(statement)
    metrics, ranks = _old_rows(IDENT, events)
    for table, lines in (("metrics", metrics), ("rank_metrics", ranks)):
        _post(server, f"INSERT INTO `{old}`.{table} FORMAT JSONEachRow", b"\n".join(lines))
    assert len(_lines(backend_rows(events)[0])) == len(metrics)
    backend = ClickHouseBackend(url=server.url, database=new, retries=0)
    backend.open(IDENT)
    backend.log(events)
    assert backend.counters.snapshot()[0]["failed"] == 0
    backend.finish("running")
    for table in ("metrics", "rank_metrics"):
        before, after = _stored(server, old, table), _stored(server, new, table)
        assert len(before) == len(metrics if table == "metrics" else ranks) >= 40
        assert after == before, table
    # the odd values are there, as themselves
    got = server.query(f"SELECT text FROM `{new}`.metrics WHERE text != '' FORMAT JSONEachRow")
    texts = {orjson.loads(line)["text"] for line in got.splitlines()}
    assert set(TEXTS) - {""} <= texts | {"true", "false"}
    assert server.count(f"SELECT count() FROM `{new}`.metrics WHERE isNaN(value)") > 0
    bits = struct.pack("<d", float(2**63 - 1)).rstrip(b"\0").hex().upper()
    assert server.count(f"SELECT count() FROM `{new}`.metrics "
                        f"WHERE hex(reinterpretAsString(value)) = '{bits}'") > 0


def test_a_store_whose_database_went_away_gets_its_schema_again(server: ClickHouse) -> None:
    db = "rows_again"
    first, second = (ClickHouseBackend(url=server.url, database=db, retries=3, backoff=0.01)
                     for _ in range(2))
    first.open(IDENT)
    first.log(_events(1, 10))
    second.open(Identity("proj-x", "other", rank=0, world_size=1, session="ef34ab"))
    second.log([{"_step": 0, "_time": 1.0, "_id": "ef34ab:1", "loss": 0.5}])
    server.query(f"DROP DATABASE `{db}`")  # an operator drops it while the run goes on
    first.log([{"_step": 99, "_time": 2.0, "_id": "ab12cd:99", "loss": 0.25}])
    for backend in (first, second):
        assert backend.counters.snapshot()[0]["failed"] == 0
        backend.finish("running")
    assert any("code 81" in cause for cause in first.counters.snapshot()[1])  # then made again
    assert server.count(f"SELECT count() FROM `{db}`.metrics WHERE step = 99") == 1


def test_the_backends_of_one_process_make_the_schema_once(httpserver: Any) -> None:
    from werkzeug import Request, Response

    calls: list[str] = []

    def handler(request: Request) -> Response:
        calls.append(request.args.get("query", ""))
        return Response("0\n" if calls[-1].startswith("SELECT") else "")

    httpserver.expect_request("/once/").respond_with_handler(handler)
    url = httpserver.url_for("/once/")  # a URL of this test's own: nothing known about it
    for r in range(4):  # exprd: a backend per spool file
        backend = ClickHouseBackend(url=url, database="once", retries=0)
        backend.open(Identity("proj", "once", rank=r, world_size=4, session=f"s{r}"))
        backend.log([{"_step": 0, "_time": 1.0, "_id": f"s{r}:1", "loss": 0.5}])
        backend.finish("running")
    assert sum(c.startswith("CREATE DATABASE") for c in calls) == 1
    assert sum(c.startswith("INSERT INTO `once`.metrics") for c in calls) == 4
