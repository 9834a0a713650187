"""Turn committed tokens into a request's output: stop rules, incremental text, finish reason.

Stop rules, checked token by token in order, so nothing past a stop is ever emitted:
- an eos id (unless ignore_eos) or a `stop_token_ids` id: the token is kept in `token_ids`,
  left out of the text, finish_reason "stop";
- a stop string: the text ends just before it, `token_ids` end with the token that completed it,
  finish_reason "stop";
- `max_tokens` tokens: finish_reason "length".

The text is decoded incrementally (`incremental=True`, as vLLM's detokenizer): each step decodes
only the tokens since the last point where the text was whole (no incomplete character at its
end) and the step before them, whose decode is subtracted, so that a decoder's treatment of a
slice's first token (SentencePiece's leading space) cancels out. A decode of the whole output each
step costs O(n) a step, O(n^2) a request: with the demo pair's tokenizer on the CPU, 4 tokens a
step, a mean 389 us a step over a 4096-token output and 1757 us over 16384, against about 10 us
incrementally at any length (`python -m benchmarks.output_text OUT.json`,
benchmarks/results/output_text_cpu.json). At every step the text equals the decode of every token
so far. `incremental=False` (a tokenizer that cleans up spaces across tokens) decodes it whole.
"""
from __future__ import annotations

from typing import Callable

from ddtree.config import SamplingParams

REPLACEMENT_CHAR = "\ufffd"


class OutputBuilder:
    def __init__(self, params: SamplingParams, eos_token_ids: list[int], decode: Callable[[list[int]], str] | None,
                 incremental: bool = True):
        self.params = params
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.decode = decode
        self.token_ids: list[int] = []
        self.text_ids: list[int] = []  # token_ids minus a final stop token
        self.text = ""
        self.sent = 0  # characters of text already handed out as deltas
        self.finish_reason: str | None = None
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1
        self.incremental = incremental
        self._whole = ""  # the text of text_ids[:_read], whole (no incomplete character at its end)
        self._prefix = 0  # text_ids[_prefix:_read]: the tokens decoded with the new ones, as context
        self._read = 0
        self._prefix_text = ""  # their decode

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, tokens: list[int]) -> list[int]:
        """Append a step's tokens up to the first stop; return the tokens actually taken."""
        taken = []
        for token in tokens:
            if self.finished:
                break
            taken.append(token)
            self.token_ids.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            self.text_ids.append(token)
            if self.params.stop and self.decode is not None and self._hit_stop_string():
                self.finish_reason = "stop"
                break
            if len(self.token_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        if not self.params.stop or self.decode is None:
            self._refresh_text()
        if len(self.token_ids) >= self.params.max_tokens and not self.finished:
            self.finish_reason = "length"
        return taken

    def _refresh_text(self) -> None:
        if self.decode is None:
            return
        if not self.incremental:
            self.text = self.decode(self.text_ids)
            return
        if len(self.text_ids) == self._read:
            return
        window = self.decode(self.text_ids[self._prefix:])
        self.text = self._whole + window[len(self._prefix_text):]
        if len(window) > len(self._prefix_text) and not window.endswith(REPLACEMENT_CHAR):
            self._whole = self.text  # whole: the next steps decode from here, these tokens as context
            self._prefix, self._read = self._read, len(self.text_ids)
            self._prefix_text = self.decode(self.text_ids[self._prefix:self._read])

    def _hit_stop_string(self) -> bool:
        prev_len = len(self.text)
        self._refresh_text()
        start = max(0, prev_len - self.hold_back)
        hits = [(self.text.find(s, start), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(i for i, _ in hits)]
        return True

    def text_delta(self) -> str:
        """New text safe to show: all of it once finished; before that, holding back a possible
        partial stop string and an incomplete multi-byte character."""
        end = len(self.text)
        if not self.finished:
            end -= self.hold_back
            while end > self.sent and self.text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
