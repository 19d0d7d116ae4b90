"""The admission stamp where it is made and checked (`step_policy.stamp` / `admitted`).

The gate stamps what it admitted — the request's task key and its `ltv_steps` as handed on
(`canonical_steps`) — with an HMAC under a key made for each start (`new_admission`); the
engine's request check re-computes it from the request as it arrives. A stamp must admit
exactly its (key, task, policy): a stamp that ignored the policy would let a request
admitted as `first` be shifted at every step, one that ignored the task would let a stamp
for one task shift with another. The gate, server and deployment tests only see the
effect of a stamp through a server (and never see a stamp: it stays in the server), so a
stamp covering half of what it should passes them; these tests check it directly, against
an HMAC computed here by hand from the documented fields.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json

import pytest

from ltv_vllm.core.vector import ALL, parse_steps
from ltv_vllm.serving.contract.wire import (
    ADMIT_ENV,
    ADMIT_KEY,
    STEPS_KEY,
    TASK_KEY,
    Admission,
    admission,
    admitted,
    canonical_steps,
    check_request,
    new_admission,
    stamp,
)

KEY = bytes(range(32))
ADM = Admission(KEY, every=False)
EVERY = Admission(KEY, every=True)

# tasks as the gate hands them on: a fused vector (""), command-line names, task-store keys
TASKS = ["", "a", "b", "A", "a@0123abcd", "a@0123abce", "b@0123abcd"]
# policies as the gate hands them on (`canonical_steps`), and None: the request named none
# (its task's default, which may be any policy: not the same as "all")
POLICIES = [None, "all", 0, 1, 2, 3, 10, (1 << 62) - 1]


def xargs(task: str, steps, mark=None) -> dict:
    """A request's `vllm_xargs` as the engine gets them (no key: not named)."""
    out = {}
    if task:
        out[TASK_KEY] = task
    if steps is not None:
        out[STEPS_KEY] = steps
    if mark is not None:
        out[ADMIT_KEY] = mark
    return out


def by_hand(key: bytes, message: bytes) -> str:
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]


@pytest.mark.parametrize(("task", "steps", "message"), [
    ("a", 2, b'["a",2]'),
    ("a", "all", b'["a","all"]'),
    ("a", None, b'["a",null]'),
    ("", 1, b'["",1]'),
    ("", None, b'["",null]'),
    ("b@0123abcd", 0, b'["b@0123abcd",0]'),
])
def test_the_stamp_is_an_hmac_of_the_task_and_the_policy(task, steps, message):
    """The documented fields, written out by hand: HMAC-SHA256 under the start's key of
    the JSON [task, steps], its first 32 hex digits."""
    want = by_hand(KEY, message)
    assert stamp(ADM, task, steps) == want
    assert admitted(xargs(task, steps, want), ADM)
    # the same message under another key is another stamp
    assert stamp(Admission(b"\x01" * 32, False), task, steps) != want


def test_a_stamp_admits_exactly_its_task_and_policy():
    """Every (task, policy) a stamp was made for against every one a request carries: the
    request is admitted if and only if they are the same — another task, another policy,
    a named policy for none (the task's default), any mix of the two."""
    made = list(itertools.product(TASKS, POLICIES))
    stamps = {tp: stamp(ADM, *tp) for tp in made}
    assert len(set(stamps.values())) == len(made)  # no two requests share a stamp
    for (t1, s1), (t2, s2) in itertools.product(made, made):
        got = admitted(xargs(t2, s2, stamps[t1, s1]), ADM)
        assert got is ((t1, s1) == (t2, s2)), (f"stamped for {(t1, s1)}", f"carries {(t2, s2)}")
        # and a request for (t2, s2) stamped by hand for (t1, s1): the same answer
        by = by_hand(KEY, json.dumps([t1, s1], separators=(",", ":")).encode())
        assert admitted(xargs(t2, s2, by), ADM) is ((t1, s1) == (t2, s2))


# spellings of a policy a request may send; the gate hands on `canonical_steps` of it
SPELLINGS = ["all", "first", 0, "0", 1, "1", "01", 2, "2", "002", 3, "3"]
NOT_A_POLICY = ["ALL", "First", "", " 2", "2.0", 2.0, 1.0, True, False, -1, "-1", "٢", "２",
                [2], {"n": 2}, 1 << 62]


def test_spellings_of_one_policy_share_a_stamp_and_others_do_not():
    """"first", 1 and "1" are one policy (the engine's `parse_steps` reads them alike), and
    the gate hands them on as one value, so they share one stamp; two spellings of different
    policies never do."""
    for a, b in itertools.product(SPELLINGS, SPELLINGS):
        same = parse_steps(a) == parse_steps(b)
        ca, cb = canonical_steps(a), canonical_steps(b)
        assert parse_steps(ca) == parse_steps(a)  # handed on as the same policy
        assert (ca == cb and type(ca) is type(cb)) is same, (a, b)
        for task in ("", "a"):
            ok = admitted(xargs(task, cb, stamp(ADM, task, ca)), ADM)
            assert ok is same, (task, a, b)
    assert canonical_steps("all") == "all" and parse_steps("all") is ALL
    assert {canonical_steps(s) for s in ("first", 1, "1", "01")} == {1}
    # a count that means "every step in effect" is still not the policy "all"
    big = canonical_steps(str((1 << 62) - 1))
    assert not admitted(xargs("a", big, stamp(ADM, "a", "all")), ADM)
    assert not admitted(xargs("a", "all", stamp(ADM, "a", big)), ADM)


@pytest.mark.parametrize("bad", NOT_A_POLICY, ids=repr)
def test_what_is_no_policy_is_refused_before_any_stamp(bad):
    """What the gate cannot hand on is refused there (`canonical_steps`) and by the engine's
    request check, whatever it was stamped with."""
    with pytest.raises(ValueError):
        canonical_steps(bad)
    with pytest.raises(ValueError):
        check_request({STEPS_KEY: bad}, prompt_logprobs=False, tasks=frozenset())


@pytest.mark.parametrize(("stamped", "sent"), [
    (2, "2"), (2, 2.0), (1, True), (0, False), (1, "first"), ("all", "ALL"), ("all", None),
    (None, "all"), (3, [3]),
])
def test_another_spelling_than_the_stamped_one_is_refused(stamped, sent):
    """The engine reads the policy as it arrives; a request whose policy is spelled other
    than the gate handed it on (a stamp moved to another body) is refused, even where the
    engine would read both spellings as one policy ("first" and 1): a refusal, never a
    shift at other steps."""
    assert not admitted(xargs("a", sent, stamp(ADM, "a", stamped)), ADM)


def test_an_explicit_null_or_empty_task_reads_as_not_named_and_is_refused_elsewhere():
    """The stamp's message cannot tell a policy of JSON null from none given, nor a task ""
    from none: both are refused by the engine's request check, so that sharing admits
    nothing the stamp did not cover."""
    mark = stamp(ADM, "", None)
    assert admitted({STEPS_KEY: None, ADMIT_KEY: mark}, ADM)
    assert admitted({TASK_KEY: "", ADMIT_KEY: mark}, ADM)
    with pytest.raises(ValueError):
        check_request({STEPS_KEY: None}, prompt_logprobs=False, tasks=frozenset({"a"}))
    with pytest.raises(ValueError):
        check_request({TASK_KEY: ""}, prompt_logprobs=False, tasks=frozenset({"a"}))


def test_a_stamp_from_another_start_is_refused():
    """Each start makes its own key (`new_admission`): a stamp made under one start's key
    admits nothing under another's, and the environment carries the key as made."""
    envs = [new_admission(every=False) for _ in range(3)]
    adms = [admission(env) for env in envs]
    assert len({a.key for a in adms}) == 3 and all(len(a.key) == 32 for a in adms)
    assert [a.every for a in adms] == [False] * 3
    assert admission(new_admission(every=True)).every is True
    for (i, a), (j, b) in itertools.product(enumerate(adms), enumerate(adms)):
        for task, steps in itertools.product(TASKS, POLICIES):
            ok = admitted(xargs(task, steps, stamp(a, task, steps)), b)
            assert ok is (i == j), (i, j, task, steps)
    # the key in the environment is the HMAC key itself
    raw = json.loads(envs[0][ADMIT_ENV])
    assert stamp(adms[0], "a", 2) == by_hand(bytes.fromhex(raw["key"]), b'["a",2]')


def forgeries(good: str, task: str, steps) -> list:
    message = json.dumps([task, steps], separators=(",", ":"))
    full = hmac.new(KEY, message.encode(), hashlib.sha256)
    flipped = "".join("0" if c != "0" else "1" for c in good[:1]) + good[1:]
    return [
        "", " ", good[:31], good[:16], good[1:], good + "0", good[:-1], good.upper(),
        flipped, good[::-1], " " + good, good + "\n",
        full.hexdigest(),                      # the untruncated HMAC
        full.digest().hex()[32:],              # its other half
        message, hashlib.sha256(message.encode()).hexdigest()[:32],  # no key
        by_hand(b"", message.encode()),        # the empty key
        good.encode(), bytearray(good.encode()), full.digest()[:16],
        int(good, 16), [good], {"stamp": good}, True, 0,
        "é" * 32, good[:31] + "é", "\ud800" * 32,  # not ASCII: refused, not an error
    ]


@pytest.mark.parametrize(("task", "steps"), [("a", 2), ("", "all"), ("b@0123abcd", None)])
def test_forged_truncated_empty_and_raw_stamps_are_refused(task, steps):
    good = stamp(ADM, task, steps)
    assert admitted(xargs(task, steps, good), ADM)
    for adm in (ADM, EVERY):
        for bad in forgeries(good, task, steps):
            assert admitted(xargs(task, steps, bad), adm) is False, repr(bad)


def test_a_request_without_a_stamp():
    """No stamp: admitted only where only tasks need one (a multi-task server) and the
    request names no task; a fused server (`every`) admits none; an engine that is not a
    served one (no key: offline) admits all."""
    for steps in POLICIES:
        assert admitted(xargs("", steps), ADM)
        assert not admitted(xargs("", steps), EVERY)
        for task in TASKS[1:]:
            assert not admitted(xargs(task, steps), ADM)
            assert not admitted(xargs(task, steps), EVERY)
            assert admitted(xargs(task, steps), None)
            assert admitted(xargs(task, steps, "0" * 32), None)
    assert admission({}) is None


def test_one_requests_stamp_never_admits_anothers():
    """The stamps of a batch of admitted requests, moved between them: each admits its own
    request only."""
    batch = [("a", 1), ("a", 2), ("a", "all"), ("a", None), ("b", 1), ("", 1), ("", None),
             ("a@0123abcd", 3), ("b@0123abcd", 3)]
    for (i, mine), (j, other) in itertools.product(enumerate(batch), enumerate(batch)):
        assert admitted(xargs(*other, stamp(ADM, *mine)), ADM) is (i == j)


def test_a_store_layer_task_s_kind_is_under_the_stamp():
    """A task-store layer task's request carries its kind (`ltv_layer`) beside its key and
    positions, all three stamped (the JSON [task, steps, layer]): another kind, a dropped
    kind or a kind added to a final-layer task's stamp is not admitted; the engine's check
    reads the kind only from a stamped store key (`request_layers`), a client's is a 400."""
    from ltv_vllm.serving.contract.wire import LAYER_KEY, request_layers

    task = "s@0123abcd"
    want = by_hand(KEY, b'["s@0123abcd","all","add"]')
    assert stamp(ADM, task, "all", "add") == want
    ok = {**xargs(task, "all", want), LAYER_KEY: "add"}
    assert admitted(ok, ADM)
    assert not admitted({**ok, LAYER_KEY: "map"}, ADM)
    assert not admitted({k: v for k, v in ok.items() if k != LAYER_KEY}, ADM)
    assert not admitted({**xargs(task, "all", stamp(ADM, task, "all")), LAYER_KEY: "add"}, ADM)
    assert request_layers(ok, ADM, {}) == {task: ("all", True)}
    assert request_layers({**ok, LAYER_KEY: "map"}, None, {"c": ("last", True)}) == \
        {"c": ("last", True), task: ("all", False)}
    for bad in ({**ok, LAYER_KEY: "map"}, {**ok, TASK_KEY: "s"}, {**ok, LAYER_KEY: "both"},
                {k: v for k, v in ok.items() if k != STEPS_KEY}):
        with pytest.raises(ValueError, match="ltv_layer is the server's own"):
            request_layers(bad, ADM, {})
