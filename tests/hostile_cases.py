"""Hostile requests for both generation endpoints, generated: every request field set to every value of
a list of wrong types, out-of-range, huge and odd values (plus values chosen for that field), malformed
and oddly encoded bodies, bodies at and over every limit, odd headers, and the cases of issue 15.

Each case is one real request; `status` and `code`, when set, are what the answer must be; otherwise
any answer below 500 will do (a mutated field may well be valid), as long as it is well formed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

C, CHAT = "/v1/completions", "/v1/chat/completions"
MODEL = "ddtree-test"
# Cheap when valid: two tokens. No tree budget, so the server's default (64) drafts.
BASE = {C: {"prompt": "def f(x):", "max_tokens": 2, "temperature": 0, "ignore_eos": True},
        CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "ignore_eos": True}}
SHARED_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                 "ignore_eos", "stream", "stream_options", "n", "tree_budget", "return_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "user"]
FIELDS = {C: ["prompt", *SHARED_FIELDS, "echo", "logprobs", "best_of", "suffix"],
          CHAT: ["messages", *SHARED_FIELDS, "max_completion_tokens", "logprobs", "top_logprobs"]}

# Raw JSON text, so that values json.dumps cannot write (NaN, 1e400, lone surrogates, 5000 digits) are sent too.
GENERIC = ["null", "true", "false", "0", "-1", "1", "1.5", "-1e308", "1e308", "1e400", "NaN", "-Infinity", '""',
           '"5"', '"\\ud800"', json.dumps("x" * 5000), "[]", "[null]", "[[[]]]", "{}", '{"a": 1}', "1" + "0" * 30,
           str(2**64), '"\\u0000"', '"\U0001F600"', '"\\u0661\\u0662"', "9" * 5000]
SPECIFIC = {
    "model": [json.dumps(MODEL), '"gpt-4o"', json.dumps(MODEL.upper())],
    "max_tokens": ["2.0", '"16"', "1e3", "100000000", "0.5"],
    "temperature": ["1e-300", "5e-324", "-0.0", "1e-5"],
    "top_p": ["1e-300", "0.999999", "1.0000001"],
    "top_k": ["8192", "8193", "1000000"],
    "seed": [str(2**63 - 1), str(2**63), str(2**64 - 1)],
    "stop": [json.dumps(["a"] * 17), json.dumps(["y" * 300]), '[""]', '["ok", 1]', '[["a"]]', '["\\ud800"]',
             json.dumps(["\n", "```", "</s>"])],
    "stop_token_ids": [json.dumps([1] * 17), "[-1]", "[1e30]", "[1.5]", '["1"]', str([2**64])],
    "stream": ['"true"'],
    "stream_options": ['{"include_usage": true}', '{"include_usage": "yes"}', '{"x": 1}'],
    "n": ["2", "1.0"],
    "tree_budget": ['"1_000"', '"+5"', '"\\u0661\\u0662"', '"\\uff15"', "4096", "513", "512", '"512"', '" 64 "',
                    '"AR"', '"chain"', '"auto"', "-5", "64.0", "64.5", '"64abc"', '"1e3"', '"0x10"'],
    "logit_bias": ['{"1": 5}', '{"a": "b"}'],
    "logprobs": ["5"],
    "echo": ['"false"'],
    "prompt": ['"ar"', "[1, 2, 3]", "[[1, 2, 3]]", '["a", "b"]', "[[]]", "[1e30]", "[-1]", "[8192]", "[1.5]",
               json.dumps("def f():\n" * 200), '"\\ud83d\\ude00 ok"', '"a\\udc00b"'],
    "messages": ['[{"role": "user", "content": "\\ud800"}]', '[{"role": "wizard", "content": "x"}]',
                 '[{"role": "user"}]', '[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]',
                 '[{"role": "user", "content": [{"type": "image", "text": "hi"}]}]',
                 '[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]',
                 '[{"role": "user", "content": [{"type": "text"}]}]', '[{"role": "user", "content": "x", "name": 5}]',
                 '[{"role": "user", "content": "x", "extra": 1}]', '[{"role": "system", "content": ""}]',
                 '[{"role": "user", "content": "{{ 7 * 7 }}{% raise %}"}]',
                 json.dumps([{"role": "user", "content": "x"}] * 2000)],
    "max_completion_tokens": ["0", "3"],
}
KNOWN_CODES = {"invalid_json", "invalid_value", "missing_required_parameter", "unsupported_parameter",
               "request_too_large", "model_not_found", "invalid_api_key", "not_found", "method_not_allowed",
               "queue_full", "engine_unavailable"}


@dataclass
class Case:
    id: str
    path: str
    body: bytes | Callable[[], bytes]
    headers: dict = field(default_factory=dict)
    status: int | None = None
    code: str | None = None
    param: object = ...  # ... : not checked

    def content(self) -> bytes:
        return self.body() if callable(self.body) else self.body


def unknown_keys_body(path: str) -> bytes:
    """Issue 15's body: 600,000 unknown keys, 8.3 MB, under the default 8 MiB body limit."""
    return json.dumps({**BASE[path], **{f"k{i}": 0 for i in range(600_000)}}).encode()


def with_field(path: str, name: str, raw: str) -> bytes:
    items = {k: json.dumps(v) for k, v in BASE[path].items()}
    items[name] = raw
    return ("{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in items.items()) + "}").encode()


def field_cases() -> list[Case]:
    cases = []
    for path in (C, CHAT):
        short = "cmpl" if path == C else "chat"
        for name in FIELDS[path]:
            for i, raw in enumerate(GENERIC + SPECIFIC.get(name, [])):
                cases.append(Case(f"{short}-{name}-{i}", path, with_field(path, name, raw)))
    return cases


MALFORMED = ["", " ", "{", "}", '{"prompt": "x",', '{"prompt": "x",}', "{'prompt': 'x'}", '{"prompt" "x"}',
             '{"prompt": x}', "[]", "[1, 2]", '"x"', "1", "null", "true", '{"prompt": "x"} {}', '{"prompt": "x"}junk',
             '{"prompt": "\x01"}', '{"prompt": "x" /* c */}', '{"prompt": "\\x"}', '{"prompt": "\\u12"}',
             '{"max_tokens": 01}', '{"max_tokens": +1}', '{"max_tokens": .5}', '{"max_tokens": 1.}', '{"a":}',
             '{,}', '{"prompt": "x"', '{"prompt": [1, 2}', '{"prompt": "x",,"n": 1}', '{"prompt": tru}',
             '{"prompt": nan}', '{"prompt": infinity}', "\x00", '{"\\ud800": 1}']


def raw_cases() -> list[Case]:
    cases = []
    for path in (C, CHAT):
        short = "cmpl" if path == C else "chat"
        good = json.dumps(BASE[path]).encode()
        for i, text in enumerate(MALFORMED):
            cases.append(Case(f"{short}-malformed-{i}", path, text.encode(), status=400))
        cases += [
            Case(f"{short}-bom", path, b"\xef\xbb\xbf" + good, status=400, code="invalid_json"),
            Case(f"{short}-invalid-utf8", path, good[:-1] + b', "user": "\xff\xfe"}', status=400, code="invalid_json"),
            Case(f"{short}-overlong-utf8", path, good[:-1] + b', "user": "\xc0\xaf"}', status=400, code="invalid_json"),
            Case(f"{short}-utf16", path, good.decode().encode("utf-16"), status=400, code="invalid_json"),
            Case(f"{short}-latin1", path, good[:-1] + ', "user": "caf\xe9"}'.encode("latin-1"), status=400,
                 code="invalid_json"),
            Case(f"{short}-deep-arrays", path, b"[" * 100_000 + b"]" * 100_000, status=400, code="invalid_json"),
            Case(f"{short}-deep-objects", path, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, status=400,
                 code="invalid_json"),
            Case(f"{short}-deep-in-field", path, good[:-1] + b', "user": ' + b"[" * 40 + b"]" * 40 + b"}",
                 status=400, code="invalid_json"),
            Case(f"{short}-70-keys", path, json.dumps({**BASE[path], **{f"k{i}": i for i in range(70)}}).encode(),
                 status=400, code="request_too_large"),
            # Unknown keys are ignored (and their names logged, cut short), whatever they are called.
            Case(f"{short}-empty-key", path, json.dumps({**BASE[path], "": 1}).encode(), status=200),
            Case(f"{short}-huge-key", path, json.dumps({**BASE[path], "k" * 1_000_000: 1}).encode(), status=200),
            Case(f"{short}-60-unknown-keys", path, json.dumps({**BASE[path], **{f"k{i}": [i] for i in range(60)}}).encode(),
                 status=200),
            Case(f"{short}-duplicate-key", path, good[:-1] + b', "max_tokens": 1}', status=200),
            Case(f"{short}-600k-unknown-keys", path, lambda p=path: unknown_keys_body(p), status=400,
                 code="request_too_large"),
            Case(f"{short}-1.5M-stop-strings", path, lambda p=path: json.dumps({**BASE[p], "stop": ["a"] * 1_500_000}).encode(),
                 status=400, code="request_too_large"),
            Case(f"{short}-9MB-body", path, lambda p=path: json.dumps({**BASE[p], "user": "u" * 9_000_000}).encode(),
                 status=400, code="request_too_large"),
            Case(f"{short}-tree-budget-4096", path, json.dumps({**BASE[path], "max_tokens": 16, "tree_budget": 4096}).encode(),
                 status=400, code="invalid_value", param="tree_budget"),
            Case(f"{short}-text-plain", path, good, {"content-type": "text/plain"}, status=400),
            Case(f"{short}-form", path, b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, status=400),
            Case(f"{short}-charset", path, good, {"content-type": "application/json; charset=utf-8"}, status=200),
            Case(f"{short}-plus-json", path, good, {"content-type": "application/vnd.api+json"}, status=200),
            Case(f"{short}-no-content-type", path, good, {"content-type": None}, status=200),
            Case(f"{short}-gzip-claimed", path, good, {"content-encoding": "gzip"}, status=200),
            Case(f"{short}-no-key", path, good, {"authorization": None}, status=401, code="invalid_api_key"),
            Case(f"{short}-bearer-only", path, good, {"authorization": "Bearer"}, status=401, code="invalid_api_key"),
            Case(f"{short}-key-lowercase-scheme", path, good, {"authorization": "bearer sk-ddtree-test"}, status=401),
            Case(f"{short}-key-longer", path, good, {"authorization": "Bearer sk-ddtree-test-2"}, status=401),
            Case(f"{short}-key-binary", path, good, {"authorization": b"Bearer \xff\xfe"}, status=401),
        ]
        # The rest of issue 15's cases that differ by endpoint.
        if path == C:
            cases += [
                Case("cmpl-7MB-prompt", path, lambda: json.dumps({**BASE[C], "prompt": "def f():\n" * 780_000}).encode(),
                     status=400, code="invalid_value", param="prompt"),
                Case("cmpl-lone-surrogate-prompt", path, with_field(C, "prompt", '"x\\ud800y"'), status=400,
                     code="invalid_value", param="prompt"),
                Case("cmpl-100k-token-ids", path, json.dumps({**BASE[C], "prompt": [5] * 100_000}).encode(),
                     status=400, code="request_too_large"),
            ]
        else:
            cases += [
                Case("chat-7MB-content", path, lambda: json.dumps({**BASE[CHAT], "messages": [
                    {"role": "user", "content": "def f():\n" * 780_000}]}).encode(), status=400, code="invalid_value",
                     param="messages"),
                Case("chat-lone-surrogate-content", path,
                     with_field(CHAT, "messages", '[{"role": "user", "content": "\\ud800"}]'), status=400,
                     code="invalid_value", param="messages.0.content"),
                Case("chat-30k-messages", path, json.dumps({**BASE[CHAT], "messages": [
                    {"role": "user", "content": "x"}] * 30_000}).encode(), status=400, code="request_too_large"),
            ]
    return cases


def all_cases() -> list[Case]:
    return field_cases() + raw_cases()
