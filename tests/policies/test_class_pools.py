"""Class-aware routing: an interactive pool, and a shared or bulk-only pool for the rest."""

from __future__ import annotations

import pytest

from engine.request import Request, RequestClass
from policies.base import create
from policies.class_pools import ClassPools
from policies.routing import Candidate, ReplicaRoutingPolicy


def chat(rid: str = "c") -> Request:
    return Request(rid, list(range(40)))


def bulk(rid: str = "b") -> Request:
    return Request(rid, list(range(40)), request_class=RequestClass.BULK)


def views(*ids: str, queues: dict[str, int] | None = None) -> list[Candidate]:
    return [Candidate(rid, (queues or {}).get(rid, 0)) for rid in ids]


def flat(ranks: list[list[str]]) -> list[str]:
    return [rid for rank in ranks for rid in rank]


def test_bulk_stays_off_the_interactive_pool_and_chat_may_use_any_replica():
    policy = create(ReplicaRoutingPolicy, "class_pools", inner="least_loaded", lend="off")
    replicas = views("r1", "r2", "r3", queues={"r2": 5, "r3": 6})
    assert policy.pools(["r1", "r2", "r3"]) == (["r1"], ["r2", "r3"])
    assert flat(policy.rank(chat(), replicas))[0] == "r1"  # the bulk-free one is least loaded
    assert sorted(flat(policy.rank(chat(), replicas))) == ["r1", "r2", "r3"]  # shared
    assert sorted(flat(policy.rank(bulk(), replicas))) == ["r2", "r3"]


def test_a_bulk_only_other_pool_keeps_interactive_in_its_own():
    policy = ClassPools(interactive_replicas=2, other_pool="bulk", inner="least_loaded")
    replicas = views("a", "b", "c")
    assert sorted(flat(policy.rank(chat(), replicas))) == ["a", "b"]
    assert flat(policy.rank(bulk(), replicas)) == ["c"]


def test_bulk_always_keeps_a_replica_and_one_replica_serves_both():
    policy = ClassPools(interactive_replicas=4, inner="least_loaded")
    assert policy.pools(["a", "b"]) == (["a"], ["b"])
    assert flat(policy.rank(bulk(), views("a", "b"))) == ["b"]
    alone = ClassPools(inner="least_loaded")
    assert flat(alone.rank(chat(), views("x"))) == ["x"]
    assert flat(alone.rank(bulk(), views("x"))) == ["x"]
    assert alone.rank(chat(), []) == []


def test_membership_is_sticky_while_the_replica_lives():
    policy = ClassPools(inner="least_loaded")
    assert policy.pools(["m", "n"])[0] == ["m"]
    assert policy.pools(["a", "m", "n"])[0] == ["m"]  # a lower id joins: m keeps its place
    assert policy.pools(["a", "n"])[0] == ["a"]  # m left: the lowest id of the rest


def test_the_inner_policy_ranks_within_a_pool_and_learns():
    policy = ClassPools(interactive_replicas=1, inner="prefix_affinity", seed=0)
    replicas = views("a", "b", "c")
    first = bulk("b1")
    chosen = policy.rank(first, replicas)[0][0]
    assert chosen in ("b", "c")
    policy.routed(first, chosen)
    assert policy.rank(bulk("b2"), replicas)[0] == [chosen]  # the same prefix, same replica


def test_bad_options_are_refused():
    with pytest.raises(ValueError):
        ClassPools(interactive_replicas=0)
    with pytest.raises(ValueError):
        ClassPools(other_pool="elsewhere")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ClassPools(inner="class_pools")
    with pytest.raises(ValueError):
        ClassPools(inner="nonexistent")
    with pytest.raises(ValueError):
        ClassPools(lend="always")  # type: ignore[arg-type]


def load(interactive: int = 0, bulk: int = 0, seats: int = 8):
    from engine.stats import AdmissionStats, ClassCounts, EngineStats, KVStats

    return EngineStats(
        model="m",
        running=ClassCounts(interactive, bulk),
        waiting=ClassCounts(),
        kv=KVStats(10, 10, 0.0, 0, 0),
        admission=AdmissionStats(8, 2, None, max_running=seats),
    )


def test_an_interactive_replica_lends_bulk_the_seats_the_throttle_allows():
    from policies.prefix_index import PrefixIndex

    index = PrefixIndex()
    policy = ClassPools(
        inner="least_loaded", lend="throttle", throttle_options={"busy_share": 0.25, "hold_s": 0.0}
    )
    policy.use_index(index)
    replicas = views("a", "b")  # a: the interactive pool
    assert flat(policy.rank(bulk(), replicas)) == ["b"]  # nothing reported yet: none lent
    index.apply({}, ["a", "b"], loads={"a": load(), "b": load(bulk=8)})
    assert sorted(flat(policy.rank(bulk(), replicas))) == ["a", "b"]  # idle: all 8 seats
    index.apply({}, ["a", "b"], loads={"a": load(interactive=2, bulk=1), "b": load()})
    assert sorted(flat(policy.rank(bulk(), replicas))) == ["a", "b"]  # 2 of 8 lent, 1 used
    index.apply({}, ["a", "b"], loads={"a": load(interactive=2, bulk=2), "b": load()})
    assert flat(policy.rank(bulk(), replicas)) == ["b"]  # its share is taken
    no_lending = ClassPools(inner="least_loaded", lend="off")
    no_lending.use_index(index)
    index.apply({}, ["a", "b"], loads={"a": load(), "b": load()})
    assert flat(no_lending.rank(bulk(), replicas)) == ["b"]


def test_by_default_an_interactive_replica_lends_only_while_it_serves_no_chat():
    from policies.prefix_index import PrefixIndex

    index = PrefixIndex()
    policy = ClassPools(inner="least_loaded", throttle_options={"hold_s": 0.0})
    policy.use_index(index)
    replicas = views("a", "b")
    index.apply({}, ["a", "b"], loads={"a": load(bulk=7), "b": load()})
    assert sorted(flat(policy.rank(bulk(), replicas))) == ["a", "b"]  # idle: a seat left
    index.apply({}, ["a", "b"], loads={"a": load(interactive=1), "b": load()})
    assert flat(policy.rank(bulk(), replicas)) == ["b"]  # chat: nothing lent
