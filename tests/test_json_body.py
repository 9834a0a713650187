"""The bounded JSON body parser: the same values as json.loads on everything json.loads accepts (and
refusals where it refuses), the limits, lone surrogates, and turns of the event loop while parsing."""
from __future__ import annotations

import asyncio
import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.server import json_body
from ddtree.server.json_body import JsonBodyError, JsonLimits, parse, parse_json_body

UNLIMITED = JsonLimits(max_depth=10_000, max_keys=10**9, max_values=10**9)


def same(a, b) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def outcome(text: str):
    try:
        return "ok", json.loads(text)
    except (ValueError, RecursionError):
        return "error", None


def ours(text: str):
    try:
        return "ok", parse(text, UNLIMITED)
    except JsonBodyError:
        return "error", None


def agree(text: str) -> None:
    expected, got = outcome(text), ours(text)
    assert expected[0] == got[0], (text, expected, got)
    assert expected[0] == "error" or same(expected[1], got[1]), text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=5), children, max_size=6),
    max_leaves=40)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(value=json_values, indent=st.sampled_from([None, 0, 2]), separators=st.sampled_from([None, (",", ":"), (" , ", " : ")]))
def test_same_values_as_json_loads(value, indent, separators):
    agree(json.dumps(value, indent=indent, separators=separators))


def test_same_refusals_as_json_loads_on_garbage():
    rng = random.Random(0)
    alphabet = list('{}[],:"\\ 0123456789-.eE+tfnrulsaNIy\n') + ["\\u00e9", "\\ud83d\\ude00"]
    fixed = ['{"a" : [1, 2.5, -0, 1e5, "x\\n", true, null, NaN, -Infinity, {"b": {}}], "a": 3}', "[1,]", '{"a":1,}',
             '{"a" 1}', "{'a':1}", "[1 2]", '{"a":1}}', "", "  ", "[", '{"a":', "[01]", "[1.]", "[.5]", '["\\x"]',
             '{"":1}', "[1e400]", "[" + "1," * 600 + "2]", "[-]", "[1,-2 , 3\n,4]", "[" + "9" * 5000 + "]",
             '"\x01"', "\ufeff{}", "1 2", "nul"]
    for text in fixed + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(20_000)]:
        agree(text)


@pytest.mark.parametrize("text, code, param", [
    ("[" * 40 + "]" * 40, "invalid_json", None),
    ('{"a": {' + ",".join(f'"k{i}": 1' for i in range(70)) + "}}", "request_too_large", "a"),
    (json.dumps({f"k{i}": i for i in range(70)}), "request_too_large", None),
    (json.dumps({"prompt": list(range(5000))}), "request_too_large", None),
    (json.dumps({"prompt": ["x"] * 5000}), "request_too_large", None),
    ('"\\ud800"', "invalid_value", None),
    ('{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "invalid_value", "messages.0.content"),
    ('{"\\ud800": 1}', "invalid_value", None),
    ('{"prompt": "x", "stop": ["ok", "\\udbff"]}', "invalid_value", "stop.1"),
])
def test_limits_and_lone_surrogates(text, code, param):
    with pytest.raises(JsonBodyError) as info:
        parse(text, JsonLimits(max_depth=32, max_keys=64, max_values=4096))
    assert (info.value.code, info.value.param) == (code, param)
    assert len(str(info.value)) < 300


def step_by_step(text: str, limits: JsonLimits):
    """parse_steps alone (no json.loads first): the value, or the refusal's (code, param, message)."""
    steps = json_body.parse_steps(text, limits)
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return "ok", done.value
    except JsonBodyError as exc:
        return "error", (exc.code, exc.param, str(exc))


def with_small_path(text: str, limits: JsonLimits):
    try:
        return "ok", parse(text, limits)
    except JsonBodyError as exc:
        return "error", (exc.code, exc.param, str(exc))


surrogate_text = st.text(max_size=4) | st.sampled_from(["\ud800", "a\udfffb", "\ud83d\ude00"])


@settings(max_examples=600, deadline=None, derandomize=True)
@given(value=st.recursive(
    st.none() | st.integers(-5, 5) | st.floats(allow_nan=True) | surrogate_text,
    lambda children: st.lists(children, max_size=7) | st.dictionaries(surrogate_text, children, max_size=7),
    max_leaves=60),
    depth=st.integers(1, 5), keys=st.integers(0, 6), values=st.integers(1, 40))
def test_a_small_body_is_read_as_step_by_step(value, depth, keys, values):
    """json.loads and the walk over its value (`_small`) give what the step-by-step parse gives,
    refusals included (the same code, parameter and message), at limits small enough to be hit."""
    text = json.dumps(value).replace("\\\\u", "\\u")  # let the sampled escapes through as escapes
    limits = JsonLimits(max_depth=depth, max_keys=keys, max_values=values)
    expected, got = step_by_step(text, limits), with_small_path(text, limits)
    assert expected[0] == got[0], (text, expected, got)
    assert same(expected[1], got[1]) if expected[0] == "ok" else expected[1] == got[1], (text, expected, got)


def test_a_large_body_skips_the_small_path(monkeypatch):
    calls = []
    loads = json.loads
    monkeypatch.setattr(json_body.json, "loads", lambda text: calls.append(len(text)) or loads(text))
    parse(json.dumps({"prompt": "x" * json_body.SMALL_BODY_CHARS}), UNLIMITED)
    parse(json.dumps({"prompt": "x"}), UNLIMITED)
    assert calls == [len(json.dumps({"prompt": "x"}))]


def test_a_surrogate_pair_is_one_character():
    assert parse('"\\ud83d\\ude00"', UNLIMITED) == "\U0001F600"


def test_invalid_utf8_is_invalid_json():
    with pytest.raises(JsonBodyError, match="UTF-8") as info:
        asyncio.run(parse_json_body(b'{"prompt": "\xff\xfe"}', UNLIMITED))
    assert info.value.code == "invalid_json"


def test_the_event_loop_turns_while_a_large_body_is_parsed():
    body = json.dumps({"prompt": [[i, "x", {"k": 1.5}] for i in range(20_000)]}).encode()

    async def run():
        turns = 0
        done = False

        async def tick():
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        value = await parse_json_body(body, UNLIMITED)
        done = True
        await ticker
        return value, turns

    value, turns = asyncio.run(run())
    assert value == json.loads(body)
    assert turns >= 20_000 * 5 // 256 // 2  # a turn every few hundred values, not one at the end
