"""Checks for notebook 14: sizing a fleet of worker hosts against max_connections, with hints
in tiers (the scenario and its right count first, the rule missed at the second slip)."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable

from . import expect, passed
from .tiers import Hints

HINTS = Hints()

# (hosts, threads, budget, pool, max_client_conn): the scenarios the answer must get right.
SCENARIOS: list[tuple[int, int, int, int | None, int]] = [
    (4, 6, 87, None, 1000),
    (2, 4, 87, None, 1000),
    (10, 4, 87, None, 1000),
    (20, 4, 87, None, 1000),
    (4, 6, 87, 20, 1000),
    (4, 8, 87, 20, 500),
    (4, 6, 22, 20, 1000),
    (2, 4, 15, 20, 1000),
    (3, 16, 200, 40, 2000),
]


def _expected(
    hosts: int, threads: int, budget: int, pool: int | None = None, max_client_conn: int = 1000
) -> int:
    """The most worker processes each of ``hosts`` may run: each process has ``threads``
    lanes (each with a connection for its handlers), a dispatcher (claims, the reaper), a
    finisher (completions, fails), a keeper (heartbeats) and a listener. Directly, every one
    of those is a server connection; through PgBouncer all but the listener are its clients
    (at most ``max_client_conn``) sharing ``pool`` server connections, and the listener is a
    direct connection."""
    if pool is None:
        return budget // (hosts * (threads + 4))
    by_server = (budget - pool) // hosts
    by_clients = max_client_conn // (hosts * (threads + 3))
    return max(0, min(by_server, by_clients))


def check_fleet(answer: object) -> None:
    """The reader's ``processes_per_host`` gives the right count in every scenario."""
    expect(
        callable(answer),
        "define a function processes_per_host(hosts, threads, budget, pool=None, "
        f"max_client_conn=1000), got {answer!r}",
    )
    assert callable(answer)
    _check_signature(answer)
    for hosts, threads, budget, pool, clients in SCENARIOS:
        call = f"processes_per_host({hosts}, {threads}, {budget}" + (
            f", pool={pool}, max_client_conn={clients})" if pool is not None else ")"
        )
        got = (
            answer(hosts, threads, budget)
            if pool is None
            else answer(hosts, threads, budget, pool=pool, max_client_conn=clients)
        )
        expect(
            isinstance(got, numbers.Integral) and not isinstance(got, bool),
            f"{call} returned {got!r}: a count of processes is a whole number (round down, //)",
        )
        assert isinstance(got, numbers.Integral)
        want = _expected(hosts, threads, budget, pool, clients)
        if got != want:
            raise_hint(call, int(got), want, hosts, threads, budget, pool, clients)
    passed(
        f"processes_per_host holds in all {len(SCENARIOS)} scenarios, directly and "
        "through PgBouncer"
    )


def raise_hint(
    call: str,
    got: int,
    want: int,
    hosts: int,
    threads: int,
    budget: int,
    pool: int | None,
    clients: int,
) -> None:
    """Fail with the symptom of the likely mistake behind ``got``, and its rule at the
    second slip of that kind."""
    kind, rule = "other", "count each process's connections again"
    if got < 0:
        kind, rule = "negative", "when the pool alone exceeds the budget no process fits: 0"
    elif pool is None:
        if got in (budget // (hosts * (threads + n)) for n in (0, 1, 2, 3)):
            kind, rule = (
                "direct",
                (
                    "each process opens threads + 4 connections: its lanes, the dispatcher "
                    "(claims, reaper), the finisher (completions, fails), the keeper "
                    "(heartbeats) and the listener (LISTEN)"
                ),
            )
    else:
        direct = budget // (hosts * (threads + 4))
        if got == direct:
            kind, rule = (
                "pooled",
                (
                    "through PgBouncer the lanes, dispatchers, finishers and keepers share "
                    "the pool's server connections: only the pool and the listeners count "
                    "against the budget"
                ),
            )
        elif got == clients // (hosts * (threads + 3)):
            kind, rule = (
                "listeners",
                (
                    "the listeners bypass PgBouncer (--listen-dsn): each process holds one "
                    "server connection of its own beside the pool"
                ),
            )
        elif got == (budget - pool) // hosts:
            kind, rule = (
                "clients",
                (
                    "every lane, dispatcher, finisher and keeper is a client of PgBouncer: "
                    "max_client_conn bounds them"
                ),
            )
        elif got in (
            min((budget - pool) // hosts, clients // (hosts * (threads + n))) for n in (2, 4)
        ):
            kind, rule = (
                "listener-client",
                (
                    "count PgBouncer's clients again: the lanes, the dispatcher, the finisher "
                    "and the keeper are, the listener is not"
                ),
            )
    HINTS.fail(kind, f"{call} returned {got}; the most that fit is {want}", rule)


def _check_signature(answer: Callable[..., object]) -> None:
    try:
        params = inspect.signature(answer).parameters
    except (TypeError, ValueError):
        return
    expect(
        {"pool", "max_client_conn"} <= set(params),
        "processes_per_host needs the keyword arguments pool=None and max_client_conn=1000",
    )
