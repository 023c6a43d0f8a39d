"""The router's approximate prefix tree, routing keys and policies, without HTTP."""

from __future__ import annotations

import itertools
import random

import pytest

from radixserve.router.keys import routing_key
from radixserve.router.policy import CacheAware, CacheAwareConfig, LeastLoad, RoundRobin, make_policy
from radixserve.router.prefix_tree import PrefixTree
from radixserve.router.workers import Worker, WorkerPool, normalize_url

A, B, C = "http://a:1", "http://b:2", "http://c:3"


def ticking_clock() -> PrefixTree:
    counter = itertools.count()
    return PrefixTree(clock=lambda: float(next(counter)))


def brute_match(sent: dict[str, list[str]], text: str) -> dict[str, int]:
    def common(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    return {w: max(common(s, text) for s in texts) for w, texts in sent.items() if texts}


def test_tree_matches_per_worker_and_splits_edges() -> None:
    t = PrefixTree()
    t.insert("hello world", A)
    t.insert("hello there", B)
    t.insert("help", A)
    assert t.match("hello world, again") == {A: 11, B: 6}
    assert t.match("hello") == {A: 5, B: 5}
    assert t.match("xyz") == {A: 0, B: 0}
    # A is on "hel" + "lo" + " world" + "p" = 12 distinct characters; B on "hello there" = 11.
    assert t.size(A) == 12 and t.size(B) == 11


def test_tree_agrees_with_brute_force_on_random_prompts() -> None:
    rng = random.Random(0)
    t = PrefixTree()
    sent: dict[str, list[str]] = {A: [], B: [], C: []}
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        w = rng.choice([A, B, C])
        t.insert(text, w)
        sent[w].append(text)
        probe = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        assert t.match(probe) == brute_match(sent, probe)
    for w, texts in sent.items():  # size: the distinct prefixes' characters, i.e. the trie's node count
        assert t.size(w) == len({s[:i] for s in texts for i in range(1, len(s) + 1)})


def test_eviction_drops_least_recently_used_leaves_first() -> None:
    t = ticking_clock()
    t.insert("system prompt: old question", A)
    t.insert("system prompt: new question", A)
    t.insert("system prompt: other", B)
    dropped = t.evict(max_chars=len("system prompt: new question"))
    assert dropped == len("old question")  # the whole leaf: eviction works in nodes
    assert t.match("system prompt: old question")[A] == len("system prompt: ")
    assert t.match("system prompt: new question")[A] == len("system prompt: new question")
    assert t.match("system prompt: other")[B] == len("system prompt: other")  # B was under its limit
    t.evict(max_chars=5)
    assert t.size(A) <= 5 and t.match("system")[A] <= 5


def test_remove_worker_forgets_only_that_worker() -> None:
    t = PrefixTree()
    t.insert("shared prefix one", A)
    t.insert("shared prefix two", B)
    t.remove_worker(A)
    assert t.match("shared prefix one") == {B: len("shared prefix ")}
    assert t.size(A) == 0 and t.size(B) == len("shared prefix two")


def key(path: str, body: dict, authorization: str | None = None) -> str:
    return routing_key(path, body, authorization)[0]


def test_chat_keys_grow_with_the_conversation_and_keep_namespaces_apart() -> None:
    turn1 = {"messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}]}
    turn2 = {
        "messages": turn1["messages"] + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    }
    k1, k2 = key("/v1/chat/completions", turn1), key("/v1/chat/completions", turn2)
    assert k2.startswith(k1) and len(k2) > len(k1)
    salted = key("/v1/chat/completions", {**turn1, "cache_salt": "s"})
    keyed = key("/v1/chat/completions", turn1, authorization="Bearer k")
    assert not salted.startswith(k1[:-1]) and not keyed.startswith(k1) and salted != keyed
    # token ids: "1 2" is not a prefix of "1 23"
    assert not key("/generate", {"input_ids": [1, 23]}).startswith(key("/generate", {"input_ids": [1, 2]}))
    assert key("/v1/completions", {"prompt": ["first", "second"]}).endswith("first")


def workers(*loads: int) -> list[Worker]:
    return [Worker(u, load=n) for u, n in zip((A, B, C), loads)]


def test_round_robin_and_least_load() -> None:
    ws = workers(0, 0, 0)
    rr = RoundRobin()
    assert [rr.choose("x", ws)[0].url for _ in range(4)] == [A, B, C, A]
    assert LeastLoad().choose("x", workers(3, 1, 2))[0].url == B
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


def test_cache_aware_follows_the_conversation_and_spreads_new_ones() -> None:
    p = CacheAware(CacheAwareConfig(cache_threshold=0.5))
    ws = workers(0, 0)
    w1, why1 = p.choose("conversation one: hello", ws)
    w2, why2 = p.choose("another talk", ws)
    assert (why1, why2) == ("smallest_tree", "smallest_tree") and w1 is not w2  # new prefixes go to the emptier tree
    w3, why3 = p.choose("conversation one: hello, and more", ws)
    assert w3 is w1 and why3 == "cache_hit"
    w4, why4 = p.choose("another talk, continued", ws)
    assert w4 is w2 and why4 == "cache_hit"


def test_cache_aware_needs_more_than_the_threshold() -> None:
    p = CacheAware(CacheAwareConfig(cache_threshold=0.5))
    ws = workers(0, 0)
    first, _ = p.choose("abcd", ws)  # goes to A (both trees empty: the first listed)
    p.tree.insert("x" * 100, first.url)  # A's tree is now the bigger one
    # "abcdefgh" matches 4 of 8 characters on A: not more than 0.5, so the smaller tree (B) wins
    assert p.choose("abcdefgh", ws) == (ws[1], "smallest_tree")
    # B was just sent "abcdefgh": "abcdefg" matches 7 of 7 there, 4 of 7 on A
    assert p.choose("abcdefg", ws) == (ws[1], "cache_hit")
    # "abcdx" matches 4 of 5 on both; equal loads: the earliest worker in the tree (A)
    assert p.choose("abcdx", ws) == (ws[0], "cache_hit")
    # equal matches again ("abcd"), and now A is busier: B
    ws[0].load = 1
    assert p.choose("abcdy", ws)[0] is ws[1]


def test_cache_aware_leaves_an_overloaded_worker_and_comes_back() -> None:
    cfg = CacheAwareConfig(cache_threshold=0.3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    p = CacheAware(cfg)
    ws = workers(0, 0)
    home, _ = p.choose("long conversation prefix, turn 1", ws)
    other = ws[1] if home is ws[0] else ws[0]
    home.load, other.load = 5, 1  # 5 - 1 = 4: not more than the absolute threshold
    assert p.choose("long conversation prefix, turn 1, turn 2", ws) == (home, "cache_hit")
    home.load = 6  # 6 - 1 > 4 and 6 > 1.5 * 1: overloaded
    assert p.choose("long conversation prefix, turn 1, turn 2, turn 3", ws) == (other, "imbalanced")
    # turn 3 went to `other`, which now holds the longest match; but 40 - 2 > 4 and 40 > 1.5 * 2: overloaded
    home.load, other.load = 2, 40
    assert p.choose("long conversation prefix, turn 1, turn 2, turn 3, turn 4", ws) == (home, "imbalanced")
    other.load = 2  # balanced again: the longest match (turn 4, sent home) wins
    assert p.choose("long conversation prefix, turn 1, turn 2, turn 3, turn 4, turn 5", ws) == (home, "cache_hit")


def test_relative_threshold_keeps_affinity_under_high_even_load() -> None:
    p = CacheAware(CacheAwareConfig(balance_abs_threshold=4, balance_rel_threshold=1.5))
    ws = workers(0, 0)
    home, _ = p.choose("prefix prefix prefix", ws)
    other = ws[1] if home is ws[0] else ws[0]
    home.load, other.load = 100, 90  # 10 apart (> 4) but 100 < 1.5 * 90: not overloaded
    assert p.choose("prefix prefix prefix and more", ws) == (home, "cache_hit")


def test_namespace_does_not_count_toward_the_match_rate() -> None:
    p = CacheAware(CacheAwareConfig(cache_threshold=0.3))
    ws = workers(0, 0)
    system = {"role": "system", "content": "short"}
    first = {"messages": [system, {"role": "user", "content": "a first question of some length"}]}
    second = {"messages": [system, {"role": "user", "content": "what differs here, in a question long enough to tell"}]}
    auth = "Bearer a-long-api-key-shared-by-every-request"
    k1, start = routing_key("/v1/chat/completions", first, auth)
    assert p.choose(k1, ws, start)[0] is ws[0]
    k2, start = routing_key("/v1/chat/completions", second, auth)
    shared = len("system") + len("short") + len("user") + 3  # the system message, and the role of the next
    assert shared / (len(k2) - start) < 0.3 < (start + shared) / len(k2)  # the case: the namespace would tip it
    assert p.choose(k2, ws, start) == (ws[1], "smallest_tree")


def test_forget_drops_affinity() -> None:
    p = CacheAware()
    ws = workers(0, 0)
    home, _ = p.choose("some conversation", ws)
    p.forget(home.url)
    assert p.tree.size(home.url) == 0
    assert p.choose("some conversation, next turn", ws)[1] == "smallest_tree"


def test_pool_urls_and_membership() -> None:
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    with pytest.raises(ValueError):
        normalize_url("ftp://x")
    pool = WorkerPool()
    w, new = pool.add("a:1")
    assert new and pool.add("http://a:1/") == (w, False)
    w.healthy = False
    assert pool.healthy() == [] and pool.remove("http://a:1") is w and w.removed and pool.all() == []
