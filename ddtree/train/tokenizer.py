"""A byte-level BPE tokenizer trained on the corpus with Hugging Face `tokenizers`, saved so that
`transformers.AutoTokenizer` loads it unchanged.

Special tokens: `<|endoftext|>` (id 0: end of a file, the model's eos and pad) and `<|mask|>`
(id 1: never in the training text; the DFlash drafter's mask token).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.config import DDTreeError

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
MAX_VOCAB = 16384
# The demo target is a code model: a chat request is read as code to continue, its messages' contents
# concatenated in order.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size & (vocab_size - 1) \
            or not 512 <= vocab_size <= MAX_VOCAB:
        raise DDTreeError(f"vocabulary size must be a power of two in [512, {MAX_VOCAB}], got {vocab_size!r}",
                          "vocab_size")


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """Train on `texts` and save tokenizer.json + tokenizer_config.json in `out`; returns the
    transformers tokenizer. The learned vocabulary may fall short of `vocab_size` on a tiny corpus;
    the model's embedding still has `vocab_size` rows."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN], min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                 mask_token=MASK_TOKEN, model_max_length=1 << 20)
    hf.chat_template = CHAT_TEMPLATE
    save_tokenizer(hf, out)
    return hf


def save_tokenizer(hf_tokenizer, out: Path) -> None:
    """save_pretrained, with the class named and the chat template kept in tokenizer_config.json so
    that transformers 4.x reads the folder as well as 5.x does."""
    out.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.save_pretrained(str(out))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    template_file = out / "chat_template.jinja"
    if template_file.is_file():
        config["chat_template"] = template_file.read_text()
        template_file.unlink()
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer.model").is_file():
        raise DDTreeError(f"target model {path}: no tokenizer files (tokenizer.json) to read the corpus with", "target")
    return AutoTokenizer.from_pretrained(str(path))


def mask_token_id(hf_tokenizer) -> int | None:
    """The tokenizer's mask token id (`mask_token`, else a `<|mask|>` token), or None."""
    if getattr(hf_tokenizer, "mask_token_id", None) is not None:
        return int(hf_tokenizer.mask_token_id)
    ids = hf_tokenizer.convert_tokens_to_ids([MASK_TOKEN])
    unk = getattr(hf_tokenizer, "unk_token_id", None)
    return int(ids[0]) if ids and ids[0] is not None and ids[0] != unk else None


def encode_stream(hf_tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """All texts as one token stream [N] (int64), each text followed by eos."""
    backend = hf_tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    ids: list[int] = []
    for encoding in encode(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)
