"""The target's tokenizer, read from its directory (`tokenizer.json` + `tokenizer_config.json`)."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

from ddtree.config import DDTreeError

# Used when the tokenizer has no chat template of its own (documented in the README).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class Tokenizer:
    """A thin wrapper over transformers' AutoTokenizer with the few calls ddtree needs."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.special_ids = set(hf_tokenizer.all_special_ids)
        self._decode_output = self._output_decoder(hf_tokenizer)

    @staticmethod
    def _output_decoder(hf):
        """`hf.decode(ids, skip_special_tokens=True)` as one call into the Rust tokenizer where that
        is all it does (a fast tokenizer whose decoding neither cleans up spaces nor is overridden):
        transformers' wrapper costs 6 us of a 7 us decode, paid per row and round while streaming."""
        from transformers import PreTrainedTokenizerFast

        backend = getattr(hf, "backend_tokenizer", None)
        if (backend is None or type(hf)._decode is not PreTrainedTokenizerFast._decode
                or getattr(hf, "clean_up_tokenization_spaces", False)):
            return lambda ids: hf.decode(ids, skip_special_tokens=True)
        return lambda ids: backend.decode(ids, skip_special_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=False)

    def decode_for_output(self, token_ids: list[int]) -> str:
        return self._decode_output(token_ids)

    @property
    def decodes_incrementally(self) -> bool:
        """Whether an output's text may be decoded a few tokens at a time (`output.OutputBuilder`):
        not where decoding cleans up spaces across tokens (" ." -> "."), which a slice cannot see."""
        return not getattr(self.hf, "clean_up_tokenization_spaces", False)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters: no token covers more of a text (byte-level
        and SentencePiece vocabularies spell each byte or character as one character)."""
        return max((len(token) for token in self.hf.get_vocab()), default=1)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        template = None if self.has_chat_template else DEFAULT_CHAT_TEMPLATE
        try:
            text = self.hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja errors raised by the model's own template
            raise DDTreeError(f"chat template failed: {exc}", "messages") from None
        return self.encode(text)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The directory's tokenizer, or None when it has no tokenizer files."""
    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        return None
    from transformers import AutoTokenizer

    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(str(path)))
    except Exception as exc:  # transformers raises many types for unreadable files
        raise DDTreeError(f"target model {path}: cannot load the tokenizer: {exc}") from None
