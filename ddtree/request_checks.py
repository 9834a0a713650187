"""What a request needs before any engine work: its prompt's token ids and the checks against the
context limit. `LLM` has them, and so does the server's front process (`ddtree.server.front_model`),
which tokenizes and checks requests while the engine decodes in a process of its own."""
from __future__ import annotations

from pathlib import Path
from typing import Union

from ddtree.config import DDTreeError, SamplingParams, shown
from ddtree.models.tokenizer import Tokenizer
from ddtree.tree_shape import TreeShape

Prompt = Union[str, list[int], dict]  # text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}


class RequestChecks:
    """Prompts to token ids and the checks on a request. A subclass sets `tokenizer` (None: token
    ids only), `target_path`, `vocab_size` and `max_model_len`, and defines `_budget`."""

    tokenizer: Tokenizer | None
    target_path: Path
    vocab_size: int
    max_model_len: int

    def _budget(self, tree_budget: object, temperature: float = 0.0, context_tokens: int = 0) -> TreeShape | None:
        raise NotImplementedError

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise DDTreeError(f"target model {self.target_path} has no tokenizer files: pass prompt token ids", "prompt")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._require_tokenizer().encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self._require_tokenizer().decode(token_ids)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        tokenizer = self._require_tokenizer()
        self._check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        return tokenizer.apply_chat_template(messages)

    @property
    def max_prompt_chars(self) -> int | None:
        """Characters beyond which no text fits in max_model_len tokens, whatever it says: every
        token covers at most the longest vocabulary entry; doubled, for normalisers that shorten text."""
        if self.tokenizer is None:
            return None
        return 2 * self.max_model_len * self.tokenizer.max_token_chars

    def _check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse a text that cannot fit before paying for its tokenization."""
        limit = self.max_prompt_chars
        if limit is not None and chars > limit:
            raise DDTreeError(f"the prompt is {chars} characters; no text over {limit} characters fits in the "
                              f"context limit of {self.max_model_len} tokens", param)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """Token ids of one prompt: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}."""
        if isinstance(prompt, dict):
            if set(prompt) == {"prompt"}:
                prompt = prompt["prompt"]
            elif set(prompt) == {"prompt_token_ids"}:
                prompt = prompt["prompt_token_ids"]
            else:
                raise DDTreeError(f"a prompt dict holds 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}",
                                  "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise DDTreeError("prompt must not be empty", "prompt")
            self._check_prompt_chars(len(prompt), "prompt")
            ids = self.encode(prompt)
            if not ids:
                raise DDTreeError("prompt encodes to no tokens", "prompt")
            return ids
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise DDTreeError("prompt must be a non-empty string or list of token ids", "prompt")
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise DDTreeError(f"prompt token ids must be integers in [0, {self.vocab_size}), got {shown(t)}", "prompt")
        return list(prompt)

    def check_request(self, prompt_ids: list[int], params: SamplingParams,
                      tree_budget: object = None) -> TreeShape | None:
        """Validate everything about a request before any work; return its tree budget (None: the
        engine chooses it when the request starts, see `_budget`)."""
        params.validate()
        budget = self._budget(tree_budget, params.temperature, len(prompt_ids))
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise DDTreeError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({shown(params.max_tokens)}) = {shown(total)} exceeds the "
                f"context limit of {self.max_model_len} tokens",
                "max_tokens" if len(prompt_ids) < self.max_model_len else "prompt",
            )
        return budget
