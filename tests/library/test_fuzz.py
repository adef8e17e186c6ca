"""Bad input, fuzzed with hypothesis: every value either works or gets one clear line
(``BadInput``, ``NotInstalled``, ``ConnectError``, or CLI exit code 2/1 without a
traceback), and nothing is ever half-written. Valid input round-trips exactly.

Bounded: a few dozen examples per property, no deadline (a shared CI machine is slow).
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from conftest import rows
from pgqueue import BadInput, ConnectError, NotInstalled, Queue, Worker, cli
from pgqueue.inputs import MAX_ATTEMPTS, MAX_BACKOFF, MAX_LEASE

FUZZ = settings(
    max_examples=30,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PGQUEUE = str(Path(sys.executable).with_name("pgqueue"))

# -- strategies ----------------------------------------------------------------------
# Text Postgres can store: no NUL, no lone surrogates (those are the bad cases below).
clean_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | clean_text
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(clean_text, inner, max_size=4),
    max_leaves=25,
)
payloads = st.dictionaries(clean_text, json_value, max_size=5)


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": True}
    for _ in range(depth):
        value = {"a": value}
    return value


bad_payloads = st.one_of(
    st.lists(json_leaf, max_size=3),  # JSON, but not an object
    json_leaf,
    st.just(b'{"a": 1}'),
    st.builds(lambda k: {k: "x\x00y"}, clean_text),  # jsonb refuses \u0000
    st.builds(lambda k: {"a": [1, {k: "\x00"}]}, clean_text),
    st.builds(lambda s: {"a": s + "\ud800"}, clean_text),  # a lone surrogate
    st.builds(lambda k: {k + "\udfff": 1}, clean_text),
    st.sampled_from([math.nan, math.inf, -math.inf]).map(lambda f: {"f": f}),
    st.just(_nested(5000)),  # deeper than JSON encoding goes
    st.just({"s": {1, 2}}),  # not JSON-serialisable at all
)
good_queue_names = st.text(
    st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
    min_size=1,
    max_size=200,
).filter(lambda name: name.strip() != "")
bad_queue_names = st.one_of(
    st.just(""),
    st.text(" \t\n", min_size=1, max_size=5),
    st.builds(lambda a, b: a + "\x00" + b, clean_text, clean_text),
    st.builds(lambda a: "q" + a + "\ud83d", clean_text),  # half of an emoji
    st.text(min_size=201, max_size=300).filter(lambda name: name.strip() != ""),
    st.none(),
    st.integers(),
    st.just(b"bytes"),
)
numbers = st.one_of(
    st.floats(),  # includes NaN, inf, -0.0, huge and tiny
    st.integers(min_value=-(10**20), max_value=10**20),
    st.booleans(),
    st.none(),
    st.sampled_from(["1", "", "nan"]),
)


def is_seconds(value: object, low: float, high: float, *, open_low: bool = False) -> bool:
    """Whether ``value`` is a number of seconds the library must accept."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if not math.isfinite(value):
        return False
    return (low < value if open_low else low <= value) and value <= high


def count(dsn: str) -> int:
    return rows(dsn, "SELECT count(*) FROM jobs")[0][0]


# -- payloads ---------------------------------------------------------------------------
@FUZZ
@given(payload=payloads, name=good_queue_names)
@example(payload={"quote": "'; DROP TABLE jobs; --", 'a"b': "\\"}, name="'; DROP TABLE jobs; --")
@example(payload={"emoji": "🚀", "nul-free": "ünï©ødé"}, name='ünï©ødé 🚀 "quoted" ;')
@example(payload={"big": 10**30, "tiny": 5e-324, "neg": -0.0}, name="x" * 200)
def test_valid_payloads_and_queue_names_round_trip(queue: Queue, payload: dict, name: str) -> None:
    """Whatever valid JSON object and queue name go in come out of claim unchanged."""
    job_id = queue.enqueue(payload, queue=name)
    [job] = queue.claim(name)
    assert (job.id, job.queue) == (job_id, name)
    assert same_json(job.payload, payload), (job.payload, payload)
    assert queue.complete(job)


def same_json(got: object, sent: object) -> bool:
    """Equal as JSON values. jsonb keeps numbers as numeric, not as doubles: a float
    whose JSON text has no fraction (``3.8e+16``) comes back as an int of that value."""
    if isinstance(sent, float):
        return isinstance(got, int | float) and float(got) == sent
    if isinstance(sent, dict):
        return (
            isinstance(got, dict)
            and got.keys() == sent.keys()
            and all(same_json(got[k], sent[k]) for k in sent)
        )
    if isinstance(sent, list):
        return (
            isinstance(got, list)
            and len(got) == len(sent)
            and all(same_json(g, s) for g, s in zip(got, sent, strict=True))
        )
    return type(got) is type(sent) and got == sent


def test_a_huge_string_round_trips(queue: Queue) -> None:
    payload = {"s": "ü" * 5_000_000}
    queue.enqueue(payload, queue="huge")
    [job] = queue.claim("huge")
    assert job.payload == payload


def test_deep_nesting_that_json_can_encode_round_trips(queue: Queue) -> None:
    payload = _nested(200)
    queue.enqueue(payload, queue="deep")
    [job] = queue.claim("deep")
    assert job.payload == payload


@FUZZ
@given(payload=bad_payloads)
def test_bad_payloads_are_refused_and_nothing_is_written(
    queue: Queue, dsn: str, payload: object
) -> None:
    before = count(dsn)
    with pytest.raises(BadInput) as info:
        queue.enqueue(payload)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    assert count(dsn) == before


@FUZZ
@given(
    good=st.lists(payloads, min_size=1, max_size=5),
    bad=bad_payloads,
    where=st.integers(min_value=0, max_value=5),
)
def test_a_bulk_enqueue_with_one_bad_item_writes_none(
    queue: Queue, dsn: str, good: list, bad: object, where: int
) -> None:
    items = [*good]
    items.insert(min(where, len(items)), bad)
    before = count(dsn)
    with pytest.raises(BadInput, match=r"payload #\d+"):
        queue.enqueue_many(items)
    assert count(dsn) == before


@FUZZ
@given(name=bad_queue_names)
def test_bad_queue_names_are_refused_everywhere(queue: Queue, dsn: str, name: object) -> None:
    """enqueue, enqueue_many, claim and retry_dead all refuse the name in one line."""
    before = count(dsn)
    calls = [
        lambda: queue.enqueue({}, queue=name),  # type: ignore[arg-type]
        lambda: queue.enqueue_many([{}], queue=name),  # type: ignore[arg-type]
        lambda: queue.claim(name),  # type: ignore[arg-type]
    ]
    if name is not None:  # retry_dead(None) means the default queue
        calls.append(lambda: queue.retry_dead(name))  # type: ignore[arg-type]
    for call in calls:
        with pytest.raises(BadInput) as info:
            call()
        assert "\n" not in str(info.value)
    assert count(dsn) == before


# -- numbers ----------------------------------------------------------------------------
@FUZZ
@given(delay=numbers, max_attempts=st.one_of(numbers, st.integers(-(2**70), 2**70)))
@example(delay=0, max_attempts=2**31)  # once overflowed the int column
@example(delay=1e-320, max_attempts=MAX_ATTEMPTS)
def test_delay_and_max_attempts_work_or_are_refused(
    queue: Queue, dsn: str, delay: object, max_attempts: object
) -> None:
    valid = is_seconds(delay, 0, 10 * 365 * 86400.0) and (
        isinstance(max_attempts, int)
        and not isinstance(max_attempts, bool)
        and 1 <= max_attempts <= MAX_ATTEMPTS
    )
    before = count(dsn)
    if valid:
        queue.enqueue({}, queue="n", delay=delay, max_attempts=max_attempts)  # type: ignore[arg-type]
        assert count(dsn) == before + 1
    else:
        with pytest.raises(BadInput):
            queue.enqueue({}, queue="n", delay=delay, max_attempts=max_attempts)  # type: ignore[arg-type]
        assert count(dsn) == before


@FUZZ
@given(lease=numbers)
@example(lease=MAX_LEASE)
@example(lease=MAX_LEASE + 1)
def test_lease_works_or_claims_nothing(queue: Queue, dsn: str, lease: object) -> None:
    queue.enqueue({}, queue="lease")
    if is_seconds(lease, 0, MAX_LEASE, open_low=True):
        [job] = queue.claim("lease", lease=lease)  # type: ignore[arg-type]
        assert queue.heartbeat(job, lease=lease)  # type: ignore[arg-type]
        assert queue.complete(job)
    else:
        with pytest.raises(BadInput):
            queue.claim("lease", lease=lease)  # type: ignore[arg-type]
        assert rows(dsn, "SELECT count(*) FROM jobs WHERE status = 'running'") == [(0,)]
        [job] = queue.claim("lease")  # clean up for the next example
        queue.complete(job)


@FUZZ
@given(backoff=numbers, error=st.text(), attempts=st.integers(1, 10**6 - 1))
@example(backoff=1.0, error="bad byte \x00 here", attempts=1)
@example(backoff=1.0, error="lone \ud800 surrogate", attempts=1)
@example(backoff=MAX_BACKOFF, error="x" * 20_000, attempts=10**6 - 1)  # once overflowed
def test_fail_takes_any_error_text_and_never_overflows(
    queue: Queue, dsn: str, backoff: object, error: str, attempts: int
) -> None:
    """Any error text is stored (escaped if Postgres cannot take it as is), any attempt
    count backs off without overflow; a bad backoff changes nothing."""
    job_id = queue.enqueue({}, queue="fail", max_attempts=MAX_ATTEMPTS)
    rows(
        dsn,
        "UPDATE jobs SET attempts = %s, fence = %s WHERE id = %s RETURNING id",
        [attempts - 1, attempts - 1, job_id],
    )
    [job] = queue.claim("fail")
    if is_seconds(backoff, 0, MAX_BACKOFF):
        assert queue.fail(job, error, backoff=backoff)  # type: ignore[arg-type]
        [(status, stored, delay)] = rows(
            dsn,
            "SELECT status, last_error, extract(epoch FROM run_at - now()) FROM jobs WHERE id = %s",
            [job_id],
        )
        assert status == "ready"
        assert len(stored) <= 6 * 10_000 and "\x00" not in stored
        assert float(delay) <= MAX_BACKOFF + 60
    else:
        with pytest.raises(BadInput):
            queue.fail(job, error, backoff=backoff)  # type: ignore[arg-type]
        assert rows(dsn, "SELECT status FROM jobs WHERE id = %s", [job_id]) == [("running",)]
    rows(dsn, "DELETE FROM jobs WHERE id = %s RETURNING id", [job_id])


@pytest.mark.parametrize(
    "call",
    [
        lambda q: q.prune(older_than=1e12),  # once overflowed timestamps
        lambda q: q.prune(older_than=math.nan),
        lambda q: q.prune(older_than=-1),
        lambda q: q.retry_dead("q", extra=2**31),  # once overflowed max_attempts
        lambda q: q.retry_dead("q", extra=0),
        lambda q: q.retry_dead("q", ids=[2**70]),  # once overflowed bigint
        lambda q: q.retry_dead("q", ids=[True]),
        lambda q: q.claim("q", limit=0),
        lambda q: q.claim("q", limit=10_001),
    ],
)
def test_out_of_range_housekeeping_is_bad_input(queue: Queue, call: Any) -> None:
    with pytest.raises(BadInput):
        call(queue)


# -- the worker: refuse up front what a job thread would die of -------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"lease": MAX_LEASE + 1},
        {"lease": math.nan},
        {"backoff": math.inf},
        {"backoff": -1},
        {"backoff": MAX_BACKOFF * 2},
        {"queue": ""},
        {"queue": "\ud800"},
        {"batch": 10_001},
        {"concurrency": 0},
    ],
)
def test_worker_refuses_bad_settings_before_starting(kwargs: dict) -> None:
    """Refused before the DSN is even looked at (so this one needs no server)."""
    with pytest.raises(BadInput):
        Worker(lambda job: None, dsn="host=/nonexistent-pgqueue-dir", **kwargs)


def test_a_handler_error_nul_or_surrogate_does_not_kill_the_worker(
    queue: Queue, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: such text made ``fail`` raise inside the job thread, which died and
    left the job running; now it is stored escaped and the job goes on (here: dead). The
    failure's log line is escaped too: a lone surrogate in it cannot be written to a UTF-8
    stream (it broke pytest-xdist's report of this very test)."""

    def poison(job: object) -> None:
        raise ValueError("bad \x00 byte and a lone \udc80 surrogate")

    job_id = queue.enqueue({}, queue="poison", max_attempts=1)
    worker = Worker(poison, queue="poison", dsn=dsn, burst=True, poll_interval=0.1)
    worker.start()
    worker.join(30)
    worker.stop(5)
    [(status, error)] = rows(dsn, "SELECT status, last_error FROM jobs WHERE id = %s", [job_id])
    assert status == "dead"
    assert "\\x00" in error and "ValueError" in error
    lines = [r.getMessage() for r in caplog.records if "ValueError" in r.getMessage()]
    assert lines, "the failed attempt is logged"
    for line in lines:
        line.encode("utf-8")  # raises for a lone surrogate


# -- the CLI: stdin fuzzed --------------------------------------------------------------
good_lines = payloads.map(lambda p: (json.dumps(p, ensure_ascii=False).encode(), True))
bad_lines = st.one_of(
    st.sampled_from([b"[1, 2]", b"1", b'"text"', b"null", b"true", b"{", b"{'a': 1}", b"}"]),
    st.sampled_from([b'{"a": NaN}', b'{"a": "\\u0000"}', b'{"a": "\\ud800"}', b'{"a": Infinity}']),
    st.binary(min_size=1, max_size=20).filter(lambda b: b"\n" not in b and b.strip() != b""),
    st.sampled_from([b"\xff\xfe{}", b'{"a": "\xc3"}', b"\x80"]),  # not UTF-8
).map(lambda line: (line, False))
blank_lines = st.sampled_from([b"", b"  ", b"\t"]).map(lambda line: (line, None))


@FUZZ
@given(lines=st.lists(st.one_of(good_lines, bad_lines, blank_lines), max_size=6))
def test_cli_enqueue_from_stdin_is_all_or_nothing(
    dsn: str,
    lines: list[tuple[bytes, bool | None]],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every line a JSON object: exit 0, one job per line. Any bad line (not UTF-8, not
    JSON, not an object, not storable): exit 2, one line on stderr, no job written."""
    before = count(dsn)
    data = b"\n".join(line for line, _ in lines) + b"\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    capsys.readouterr()
    code = cli.main(["--dsn", dsn, "enqueue", "stdin"])
    err = capsys.readouterr().err
    # A line of random bytes may happen to be valid JSON: judge it as the CLI must.
    expected_ok = all(_line_is_a_storable_object(line) for line, tag in lines if tag is not None)
    if expected_ok:
        assert code == 0, err
        assert count(dsn) == before + sum(tag is not None for _, tag in lines)
    else:
        assert code == 2
        assert err.startswith("pgqueue enqueue: ") and err.count("\n") == 1, err
        assert count(dsn) == before


def _line_is_a_storable_object(line: bytes) -> bool:
    try:
        value = json.loads(line.decode("utf-8"))
        text = json.dumps(value, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
    except (UnicodeError, ValueError):
        return False
    return isinstance(value, dict) and "\\u0000" not in text


def test_cli_non_utf8_stdin_as_a_real_process(dsn: str) -> None:
    """The console script itself: exit 2, one line, no traceback, nothing written."""
    result = subprocess.run(
        [PGQUEUE, "--dsn", dsn, "enqueue", "q"],
        input=b'{"ok": 1}\n\xff\xfe\x00garbage\n',
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert b"Traceback" not in result.stderr and result.stderr.count(b"\n") == 1
    assert count(dsn) == 0


@pytest.mark.parametrize(
    "args",
    [
        ["enqueue", "q", "{}", "--max-attempts", str(2**31)],
        ["enqueue", "q", "{}", "--delay", "nan"],
        ["enqueue", "q\udcff", "{}"],  # a non-UTF-8 byte in argv, as Python decodes it
        ["prune", "--older-than", "1e12"],
        ["retry-dead", "q", "--extra", str(2**31)],
        ["worker", "tests.handlers:noop", "--lease", "1e7"],
        ["worker", "tests.handlers:noop", "--backoff", "inf"],
    ],
)
def test_cli_out_of_range_values_exit_2(
    dsn: str, args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--dsn", dsn, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert count(dsn) == 0


# -- handler paths, DSNs, a missing table -------------------------------------------------
@FUZZ
@given(
    spec=st.one_of(
        st.text(max_size=30), st.from_regex(r"[a-z_.]{0,12}:[a-z_]{0,8}", fullmatch=True)
    )
)
@example(spec="no.such.module:handler")
@example(spec="pgqueue.tools.chaos:no_such_function")
@example(spec="pgqueue.tools.chaos:KINDS")  # not callable
@example(spec="pgqueue.tools.chaos")
@example(spec=":handler")
def test_a_handler_path_that_does_not_import_is_one_usage_error(spec: str) -> None:
    """Never a traceback: a callable, or ``UsageError`` in one line."""
    module = spec.partition(":")[0]
    # Only names that cannot be real modules with import side effects (this, antigravity).
    if module and not module.startswith(("pgqueue", "no.such")):
        spec = "zz_no_such_" + spec
    try:
        handler = cli.load_handler(spec)
    except cli.UsageError as exc:
        assert "\n" not in str(exc)
    else:
        assert callable(handler)


def test_a_handler_module_that_raises_on_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "broken_tasks.py").write_text("raise RuntimeError('no config file')\n")
    (tmp_path / "syntax_tasks.py").write_text("def f(:\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(cli.UsageError, match="RuntimeError: no config file"):
        cli.load_handler("broken_tasks:f")
    with pytest.raises(cli.UsageError, match="SyntaxError"):
        cli.load_handler("syntax_tasks:f")


@FUZZ
@given(dsn=st.text(max_size=60))
@example(dsn="host=/nonexistent-pgqueue-dir port=1")
@example(dsn="postgresql://nobody@/nodb?host=/nonexistent-pgqueue-dir")
@example(dsn="postgresql://[::1")
@example(dsn="host='unterminated")
def test_a_wrong_or_unreachable_dsn_is_one_connect_error(dsn: str) -> None:
    """Any text as a DSN: connected (never, here) or ``ConnectError`` in one line."""
    target = f"{dsn} host=/nonexistent-pgqueue-dir" if "=" in dsn else dsn
    if not target.strip():
        return  # empty means "use the default": not this test's business
    with pytest.raises(ConnectError) as info:
        Queue(target)
    assert "\n" not in str(info.value)


MISSING_TABLE_CALLS = {
    "enqueue": lambda q: q.enqueue({}),
    "enqueue_many": lambda q: q.enqueue_many([{}, {}]),
    "claim": lambda q: q.claim(),
    "reap": lambda q: q.reap(),
    "retry_dead": lambda q: q.retry_dead(),
    "stats": lambda q: q.stats(),
    "prune": lambda q: q.prune(),
}


def test_a_missing_table_says_run_init(empty_dsn: str) -> None:
    """Every call that needs the jobs table says what to do, in one line."""
    with Queue(empty_dsn) as q:
        for name, call in MISSING_TABLE_CALLS.items():
            with pytest.raises(NotInstalled, match="pgqueue init") as info:
                call(q)
            assert "\n" not in str(info.value), name


def test_run_at_must_be_timezone_aware(queue: Queue, dsn: str) -> None:
    with pytest.raises(BadInput):
        queue.enqueue({}, run_at=datetime(2030, 1, 1))
    queue.enqueue({}, run_at=datetime(2030, 1, 1, tzinfo=timezone.utc))
    assert count(dsn) == 1
