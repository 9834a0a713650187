"""/tokenize and /detokenize, in vLLM's shapes: the served tokenizer, so that clients count and read
tokens exactly as the server does.

    POST /tokenize   {"prompt": "text"}  or  {"messages": [...], "add_generation_prompt": true}
                     -> {"count", "max_model_len", "tokens": [ids], "token_strs": null}
    POST /detokenize {"tokens": [ids]}  -> {"prompt": "text"}

`add_special_tokens` defaults to what the generation endpoints do: none added to a text prompt (the
chat template writes its own), so /tokenize gives the ids a completion of the same text prefills.
"""
from __future__ import annotations

from typing import Optional

from pydantic import Field

from ddtree.config import DDTreeError, shown
from ddtree.server.protocol import ChatMessage, Int, LenientModel


class TokenizeRequest(LenientModel):
    model: Optional[str] = Field(None, description="the served model name (default: the only one served)")
    prompt: Optional[str] = Field(None, description="text to tokenize (or messages)")
    messages: Optional[list[ChatMessage]] = Field(None, description="chat messages, rendered with the chat template")
    add_generation_prompt: bool = Field(True, description="with messages: end with the assistant's turn")
    add_special_tokens: bool = Field(False, description="let the tokenizer add its special tokens (bos, ...)")

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise DDTreeError("send exactly one of prompt and messages", "prompt" if self.messages is None else "messages")


class DetokenizeRequest(LenientModel):
    model: Optional[str] = None
    tokens: list[Int] = Field(..., description="token ids")


def _tokenizer(llm):
    if llm.tokenizer is None:
        raise DDTreeError(f"the target model {llm.target_name} has no tokenizer", "prompt")
    return llm.tokenizer


def _check_chars(llm, chars: int, param: str) -> None:
    """Refuse a text no context could hold before paying for its tokenization."""
    limit = llm.max_prompt_chars
    if limit is not None and chars > limit:
        raise DDTreeError(f"the text is {chars} characters; no text over {limit} characters fits in the context "
                          f"limit of {llm.max_model_len} tokens", param)


def tokenize(llm, body: TokenizeRequest) -> dict:
    """The /tokenize answer (tokenizes: run it in a worker thread)."""
    body.check()
    tokenizer = _tokenizer(llm)
    if body.messages is not None:
        messages = [m.as_template_message() for m in body.messages]
        _check_chars(llm, sum(len(m["content"]) for m in messages), "messages")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    else:
        _check_chars(llm, len(body.prompt), "prompt")
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids, "token_strs": None}


def detokenize(llm, body: DetokenizeRequest) -> dict:
    """The /detokenize answer; ids outside the vocabulary are refused."""
    tokenizer = _tokenizer(llm)
    for i, token in enumerate(body.tokens):
        if not 0 <= token < llm.vocab_size:
            raise DDTreeError(f"tokens.{i}: token ids must be in [0, {llm.vocab_size}), got {shown(token)}", "tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
