"""Replica routing policies: prefix affinity with a load guard, least loaded."""

from __future__ import annotations

import pytest

from engine.request import Request
from policies.base import create
from policies.routing import Candidate, LeastLoaded, PrefixAffinity, ReplicaRoutingPolicy

SYSTEM = list(range(100, 164))  # a 64-token shared prefix: 4 blocks of 16


def req(rid: str, tail: list[int], head: list[int] = SYSTEM) -> Request:
    return Request(rid, head + tail)


def views(**queues: int | None) -> list[Candidate]:
    return [Candidate(rid, q) for rid, q in queues.items()]


def first(ranks: list[list[str]]) -> list[str]:
    return ranks[0]


def test_policies_are_registered_by_name():
    assert isinstance(create(ReplicaRoutingPolicy, "prefix_affinity"), PrefixAffinity)
    assert isinstance(create(ReplicaRoutingPolicy, "least_loaded"), LeastLoaded)
    with pytest.raises(ValueError):
        PrefixAffinity(block_size=0)


def test_a_shared_prefix_follows_the_replica_that_holds_it():
    policy = PrefixAffinity(seed=0)
    replicas = views(a=0, b=0, c=0)
    one = req("1", [1, 2, 3])
    ranks = policy.rank(one, replicas)
    assert sorted(rid for rank in ranks for rid in rank) == ["a", "b", "c"]  # each once
    chosen = first(ranks)[0]
    policy.routed(one, chosen)
    for i in range(5):  # same system prompt, different questions
        later = req(f"q{i}", [i, i + 1, i + 2] * 7)
        assert first(policy.rank(later, replicas)) == [chosen]
        assert policy.match(later, {"a", "b", "c"}) == (chosen, 4)


def test_the_longest_match_wins():
    policy = PrefixAffinity(seed=0)
    live = {"a", "b"}
    policy.routed(req("short", [], head=SYSTEM[:32]), "a")  # 2 blocks on a
    policy.routed(req("long", [7] * 32), "b")  # the same 4 blocks + 2 more on b (newer)
    assert policy.match(req("x", [7] * 32 + [9] * 16), live) == ("b", 6)
    # an unrelated prompt matches nothing and goes by load
    other = req("y", [5] * 40, head=[])
    assert policy.match(other, live) == (None, 0)
    assert first(policy.rank(other, views(a=3, b=1))) == ["b"]


def test_affinity_yields_to_a_much_shorter_queue():
    policy = PrefixAffinity(max_imbalance=4, seed=0)
    policy.routed(req("1", [1]), "a")
    assert first(policy.rank(req("2", [2]), views(a=4, b=0))) == ["a"]  # within the slack
    ranks = policy.rank(req("3", [3]), views(a=5, b=0))
    assert first(ranks) == ["b", "a"]  # too hot: least loaded first


def test_gone_replicas_are_forgotten_and_the_index_is_bounded():
    policy = PrefixAffinity(max_blocks=8, seed=0)
    policy.routed(req("1", [1]), "a")
    assert policy.match(req("2", [2]), {"b"}) == (None, 0)  # a is not live
    policy.forget({"b"})
    assert policy.match(req("3", [3]), {"a", "b"}) == (None, 0)
    for i in range(10):
        policy.routed(req(f"r{i}", [], head=[1000 * i + t for t in range(32)]), "b")
    assert len(policy._owner) == 8  # the oldest blocks went first
    assert policy.match(req("new", [], head=[9000 + t for t in range(32)]), {"b"})[1] == 2
    assert policy.match(req("old", [], head=list(range(32))), {"b"}) == (None, 0)


def test_prompts_shorter_than_a_block_and_unknown_requests_go_by_load():
    policy = PrefixAffinity(seed=0)
    assert first(policy.rank(req("s", [], head=[1, 2, 3]), views(a=2, b=0))) == ["b"]
    assert first(policy.rank(None, views(a=2, b=0, c=1))) == ["b", "c"]
    policy.routed(None, "a")  # nothing to learn
    assert policy.rank(req("z", [1]), []) == []


def test_new_prefixes_spread_evenly_over_equally_loaded_replicas():
    """Each new prefix goes to the replica holding the fewest blocks, so 12 prefixes split
    6/6 over two pools (by chance they would split 8/4 or worse a third of the time)."""
    policy = PrefixAffinity(seed=0)
    replicas = views(a=0, b=0)
    placed: dict[str, int] = {"a": 0, "b": 0}
    for p in range(12):
        prompt = req(f"p{p}", [1], head=[1000 * p + t for t in range(48)])
        chosen = first(policy.rank(prompt, replicas))[0]
        policy.routed(prompt, chosen)
        placed[chosen] += 1
    assert placed == {"a": 6, "b": 6}
    # a shorter queue still wins over an emptier cache
    prompt = req("busy", [1], head=[99_000 + t for t in range(48)])
    assert first(policy.rank(prompt, views(a=0, b=3))) == ["a"]
    assert first(policy.rank(prompt, views(a=3, b=0))) == ["b"]


def test_least_loaded_offers_the_two_shortest_queues_first():
    policy = LeastLoaded(seed=0)
    ranks = policy.rank(None, views(a=5, b=None, c=2, d=9))
    assert ranks == [["b", "c"], ["a"], ["d"]]  # an unknown queue counts as empty
