"""Request bodies parsed as JSON within limits, a slice at a time.

`json.loads` holds the event loop (and the GIL) for the whole body: 0.8 s for 11 MB of small keys,
during which no other request is answered. Here strings, numbers and literals are still read by the
standard library's C scanner (so they come out exactly as `json.loads` gives them, NaN and Infinity
included), while objects and arrays are walked in Python, counting depth, keys and values against
`JsonLimits` and handing the loop back every few hundred values. A body over a limit is refused as
soon as the limit is passed, so a flood of keys costs no more than the limit's worth of parsing.

Strings that hold a lone UTF-16 surrogate ("\\ud800" is valid JSON, but no valid text) are refused
here, since tokenizers cannot encode them.

A small body (a chat turn, `SMALL_BODY_CHARS`) is read by `json.loads` at once, its bounded time
being short, and the value it gives walked against the same limits: `parse_json_body` took 15 us
instead of 44 for a 400-byte chat request (2-core CPU). Anything that walk or
json.loads refuses is parsed again step by step, so refusals keep that parse's messages and order.
"""
from __future__ import annotations

import asyncio
import codecs
import json
import json.decoder
import json.scanner
import re
from dataclasses import dataclass
from typing import Any, Generator

DECODE_SLICE = 1 << 20  # bytes decoded between two turns of the loop
SMALL_BODY_CHARS = 16384  # a body this short is read by json.loads at once (about 0.2 ms at most)
VALUES_PER_TURN = 256  # JSON values parsed between two turns of the loop

_WHITESPACE = re.compile(r"[ \t\n\r]*")
# Up to VALUES_PER_TURN JSON integers, each followed by a comma (the last one is left to the scanner).
_INTEGER_RUN = re.compile(r"(?:-?(?:0|[1-9][0-9]{0,17})[ \t\n\r]*,[ \t\n\r]*){1,%d}" % VALUES_PER_TURN)
_SURROGATE = re.compile("[\ud800-\udfff]")
_scan_value = json.scanner.make_scanner(json.JSONDecoder())  # the C scanner json.loads uses
_scan_string = json.decoder.scanstring


@dataclass(frozen=True)
class JsonLimits:
    max_depth: int = 32
    max_keys: int = 64  # per object
    max_values: int = 100_000  # in the whole body, containers included


class JsonBodyError(Exception):
    """The body is not JSON within the limits: `code` is "invalid_json" or "request_too_large"."""

    def __init__(self, message: str, code: str = "invalid_json", param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


async def parse_json_body(body: bytes, limits: JsonLimits) -> Any:
    """The body's JSON value; raises JsonBodyError. Yields to the event loop as it goes."""
    text = await _decode_utf8(body)
    value = _small(text, limits)
    if value is not _REFUSED:
        return value
    steps = parse_steps(text, limits)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
        await asyncio.sleep(0)


def parse(text: str, limits: JsonLimits) -> Any:
    """parse_json_body without the turns, for callers that are not on an event loop."""
    value = _small(text, limits)
    if value is not _REFUSED:
        return value
    steps = parse_steps(text, limits)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


_REFUSED = object()


def _small(text: str, limits: JsonLimits) -> Any:
    """A small text's value by json.loads, if it is JSON within `limits` with no lone surrogate, else
    _REFUSED (then `parse_steps` finds what is wrong)."""
    if len(text) > SMALL_BODY_CHARS:
        return _REFUSED
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return _REFUSED
    return value if _within(value, limits) else _REFUSED


def _within(value: Any, limits: JsonLimits) -> bool:
    """Whether a parsed value keeps `parse_steps`' limits: containers nested at most max_depth deep,
    objects of at most max_keys keys, at most max_values values (containers included), and no
    string (key or value) with a lone surrogate."""
    values = 0
    pending = [(value, 0)]  # (value, containers around it)
    while pending:
        item, depth = pending.pop()
        values += 1
        kind = type(item)
        if kind is str:
            if _SURROGATE.search(item):
                return False
        elif kind is list or kind is dict:
            if depth >= limits.max_depth:
                return False
            if kind is dict:
                if len(item) > limits.max_keys or any(_SURROGATE.search(key) for key in item):
                    return False
                item = item.values()
            pending.extend((child, depth + 1) for child in item)
        if values + len(pending) > limits.max_values:
            return False
    return True


async def _decode_utf8(body: bytes) -> str:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts = []
    try:
        for start in range(0, len(body), DECODE_SLICE):
            parts.append(decoder.decode(body[start : start + DECODE_SLICE]))
            if start + DECODE_SLICE < len(body):
                await asyncio.sleep(0)
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError as exc:
        raise JsonBodyError(f"request body is not valid UTF-8 (byte {start + exc.start}): {exc.reason}") from None
    return "".join(parts)


def _fail(message: str, text: str, pos: int) -> JsonBodyError:
    # json's own wording and position: "Expecting value: line 1 column 9 (char 8)".
    return JsonBodyError(f"request body is not valid JSON: {json.JSONDecodeError(message, text, pos)}")


def _param(stack: list, last: Any = None) -> str | None:
    path = [str(frame[1] if isinstance(frame[0], dict) else len(frame[0])) for frame in stack]
    if last is not None:
        path.append(str(last))
    return ".".join(path) or None


def _check_text(value: str, raw_start: int, raw_end: int, text: str, stack: list) -> None:
    """Refuse a string holding a lone surrogate. Only a \\u escape can make one (the body decoded
    as strict UTF-8), so only strings with one are searched."""
    if text.find("\\u", raw_start, raw_end) >= 0 and _SURROGATE.search(value):
        raise JsonBodyError("request body holds a string with a lone UTF-16 surrogate (such as \\ud800), "
                            "which is not valid Unicode text", code="invalid_value", param=_param(stack))


def parse_steps(text: str, limits: JsonLimits) -> Generator[None, None, Any]:
    """Parse `text`, yielding every VALUES_PER_TURN values; the generator returns the value."""
    stack: list[list] = []  # open containers, innermost last: [container, key being filled]
    values = 0
    pos = _WHITESPACE.match(text, 0).end()
    while True:
        # -- a value starts at pos ---------------------------------------------------------------
        values += 1
        if values > limits.max_values:
            raise JsonBodyError(f"request body holds more than {limits.max_values} JSON values",
                                code="request_too_large")
        if values % VALUES_PER_TURN == 0:
            yield
        if stack and type(stack[-1][0]) is list:
            # A run of integers (a prompt of token ids) in one regex match and one split: json.loads's
            # speed instead of a Python step per value.
            run = _INTEGER_RUN.match(text, pos)
            if run is not None:
                items = text[pos : run.end()].split(",")[:-1]
                values += len(items) - 1
                if values > limits.max_values:
                    raise JsonBodyError(f"request body holds more than {limits.max_values} JSON values",
                                        code="request_too_large")
                stack[-1][0].extend(map(int, items))
                pos = run.end()
                yield
                continue
        char = text[pos : pos + 1]
        if char in ("{", "["):
            if len(stack) >= limits.max_depth:
                raise JsonBodyError(f"request body nests objects and arrays deeper than {limits.max_depth} levels")
            pos = _WHITESPACE.match(text, pos + 1).end()
            if char == "{":
                if text[pos : pos + 1] == "}":
                    value, pos = {}, pos + 1
                else:
                    stack.append([{}, None])
                    pos = _read_key(text, pos, stack)
                    continue
            elif text[pos : pos + 1] == "]":
                value, pos = [], pos + 1
            else:
                stack.append([[], None])
                continue
        else:
            try:
                value, end = _scan_value(text, pos)
            except StopIteration as exc:
                raise _fail("Expecting value", text, exc.value) from None
            except ValueError as exc:  # a number too long to convert
                raise JsonBodyError(f"request body is not valid JSON: {exc}") from None
            if type(value) is str:
                _check_text(value, pos, end, text, stack)
            pos = end
        # -- a value ends at pos: add it to its container, closing every container that ends here --
        while True:
            if not stack:
                pos = _WHITESPACE.match(text, pos).end()
                if pos != len(text):
                    raise _fail("Extra data", text, pos)
                return value
            container, key = stack[-1]
            if type(container) is dict:
                container[key] = value
                if len(container) > limits.max_keys:
                    raise JsonBodyError(f"request body has an object with more than {limits.max_keys} keys",
                                        code="request_too_large", param=_param(stack[:-1]) if len(stack) > 1 else None)
            else:
                container.append(value)
            pos = _WHITESPACE.match(text, pos).end()
            char = text[pos : pos + 1]
            if char == ",":
                pos = _WHITESPACE.match(text, pos + 1).end()
                if type(container) is dict:
                    pos = _read_key(text, pos, stack)
                break
            if char == ("}" if type(container) is dict else "]"):
                value, pos = container, pos + 1
                stack.pop()
                continue
            raise _fail("Expecting ',' delimiter", text, pos)


def _read_key(text: str, pos: int, stack: list) -> int:
    """Read `"key" :` at pos into the innermost object's frame; return where its value starts."""
    if text[pos : pos + 1] != '"':
        raise _fail("Expecting property name enclosed in double quotes", text, pos)
    try:
        key, end = _scan_string(text, pos + 1)
    except json.JSONDecodeError as exc:
        raise JsonBodyError(f"request body is not valid JSON: {exc}") from None
    _check_text(key, pos, end, text, stack[:-1])
    stack[-1][1] = key
    pos = _WHITESPACE.match(text, end).end()
    if text[pos : pos + 1] != ":":
        raise _fail("Expecting ':' delimiter", text, pos)
    return _WHITESPACE.match(text, pos + 1).end()
