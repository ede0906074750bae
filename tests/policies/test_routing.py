"""Replica routing policies: prefix affinity (by what replicas hold, with a load guard),
least loaded, round robin."""

from __future__ import annotations

import pytest

from engine.kv.sketch import PrefixSketch
from engine.request import Request
from policies.base import create
from policies.prefix_index import PrefixIndex
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
    assert len(policy._sent) == 8  # the oldest blocks went first
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


def held(sketch: PrefixSketch, *hashes: int, full: bool = True):
    for h in hashes:
        sketch.added(h)
    return sketch.take(full=full)


def test_round_robin_takes_replicas_in_turn_whatever_they_hold():
    policy = create(ReplicaRoutingPolicy, "round_robin")
    replicas = views(b=5, a=0, c=0)
    firsts = [first(policy.rank(req(f"{i}", [1]), replicas)) for i in range(4)]
    assert firsts == [["a"], ["b"], ["c"], ["a"]]
    assert sorted(rid for rank in policy.rank(None, replicas) for rid in rank) == ["a", "b", "c"]


def test_affinity_routes_by_what_replicas_report_holding():
    """The index (what each replica's cache holds) decides, not where requests were sent."""
    index = PrefixIndex()
    policy = PrefixAffinity(seed=0)
    policy.use_index(index)
    prompt = req("q", [1] * 20)
    blocks = index.prompt_hashes("q", prompt.prompt_token_ids, 256)
    assert len(blocks) == 5
    b, c = PrefixSketch(), PrefixSketch()
    index.apply({"b": held(b, *blocks[:2]), "c": held(c, *blocks[:4])}, live={"a", "b", "c"})
    assert policy.match(prompt, {"a", "b", "c"}) == ("c", 4)
    assert first(policy.rank(prompt, views(a=0, b=0, c=2))) == ["c"]
    # c evicts its blocks: the next sync says so, and b (2 blocks) is now the holder
    for h in blocks[:4]:
        c.removed(h)
    index.apply({"c": c.take()}, live={"a", "b", "c"})
    assert policy.match(prompt, {"a", "b", "c"}) == ("b", 2)
    # a replica gone from the control plane's view is forgotten
    index.apply({}, live={"a", "c"})
    assert "b" not in index and policy.match(prompt, {"a", "c"}) == (None, 0)


def test_recently_sent_blocks_bridge_the_gap_until_the_next_report():
    now = [100.0]
    index = PrefixIndex()
    policy = PrefixAffinity(recent_s=2.0, seed=0, clock=lambda: now[0])
    policy.use_index(index)
    index.apply({"a": held(PrefixSketch()), "b": held(PrefixSketch())}, live={"a", "b"})
    first_one = req("1", [1] * 40)
    chosen = first(policy.rank(first_one, views(a=0, b=0)))[0]
    policy.routed(first_one, chosen)
    burst = req("2", [1] * 40)  # the same prefix before any report shows it cached
    assert first(policy.rank(burst, views(a=0, b=0))) == [chosen]
    now[0] += 3.0  # no report ever showed it: the replica no longer counts as holding it
    assert policy.match(burst, {"a", "b"}) == (None, 0)


def test_a_new_prefix_goes_to_the_emptiest_cache_the_index_reports():
    index = PrefixIndex()
    policy = PrefixAffinity(seed=0)
    policy.use_index(index)
    index.apply(
        {"a": held(PrefixSketch(), *range(50)), "b": held(PrefixSketch(), 99)}, live={"a", "b"}
    )
    assert first(policy.rank(req("n", [3] * 40, head=[]), views(a=0, b=0))) == ["b"]
