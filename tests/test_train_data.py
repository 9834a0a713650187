"""The training corpus (held-out split by path hash) and the BPE tokenizer."""
from __future__ import annotations

import pytest
import torch

from ddtree.config import DDTreeError
from ddtree.train.corpus import is_held_out, load_corpus, read_texts, stdlib_root
from ddtree.train.tokenizer import (EOS_TOKEN, MASK_TOKEN, check_vocab_size, encode_stream, mask_token_id,
                                    train_tokenizer)
from train_helpers import write_corpus


def test_stdlib_split_is_deterministic_disjoint_and_about_the_fraction():
    a, b = load_corpus(None, 0.05), load_corpus(None, 0.05)
    assert a.train_files == b.train_files and a.held_out_files == b.held_out_files
    assert a.roots == [stdlib_root()]
    assert not set(a.train_files) & set(a.held_out_files)
    share = len(a.held_out_files) / (len(a.train_files) + len(a.held_out_files))
    assert 0.02 < share < 0.10
    assert not any("site-packages" in p.parts for p in a.train_files + a.held_out_files)
    # The rule is a function of the relative path alone, and a larger fraction only adds files.
    root = stdlib_root()
    assert all(is_held_out(p.relative_to(root).as_posix(), 0.05) for p in a.held_out_files)
    assert set(a.held_out_files) <= set(load_corpus(None, 0.2).held_out_files)


def test_corpus_folder_and_bad_corpora(tmp_path):
    corpus = load_corpus([write_corpus(tmp_path / "c")], 0.2)
    assert len(corpus.train_files) + len(corpus.held_out_files) == 30 and corpus.held_out_files
    assert "held-out .py files of" in corpus.describe()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no python here")
    with pytest.raises(DDTreeError, match="no .py files"):
        load_corpus([tmp_path / "empty"])
    with pytest.raises(DDTreeError, match="does not exist"):
        load_corpus([tmp_path / "missing"])
    with pytest.raises(DDTreeError, match="held-out fraction"):
        load_corpus(None, 1.5)
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "a.py").write_text("x = 1\n")
    with pytest.raises(DDTreeError, match="none falls in the held-out"):
        load_corpus([tmp_path / "one"], 1e-9)


def test_read_texts_skips_files_that_are_not_utf8(tmp_path):
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("x = 'é'\n", encoding="utf-8")
    bad.write_bytes(b"x = '\xe9'\n")
    assert read_texts([good, bad]) == ["x = 'é'\n"]


@pytest.mark.parametrize("size", [256, 1000, 32768, True, "8192"])
def test_vocab_size_must_be_a_power_of_two_up_to_16384(size):
    with pytest.raises(DDTreeError, match="power of two"):
        check_vocab_size(size)


def test_tokenizer_loads_in_transformers_with_eos_mask_and_chat_template(tmp_path):
    from transformers import AutoTokenizer

    texts = read_texts(load_corpus([write_corpus(tmp_path / "c")], 0.2).train_files)
    train_tokenizer(texts, 1024, tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert tok.convert_ids_to_tokens([0, 1]) == [EOS_TOKEN, MASK_TOKEN]
    assert tok.eos_token_id == 0 and mask_token_id(tok) == 1
    assert len(tok) <= 1024
    code = "def f(x):\n    \"\"\"Ünïcode → ok.\"\"\"\n\treturn {x: [1, 2]}  # done\n"
    ids = tok.encode(code, add_special_tokens=False)
    assert tok.decode(ids) == code and len(ids) < len(code.encode()) and max(ids) < 1024
    assert tok.apply_chat_template([{"role": "user", "content": "import os"}], tokenize=False) == "import os"
    stream = encode_stream(tok, ["a = 1\n", "b = 2\n"], tok.eos_token_id)
    assert stream.dtype == torch.long
    assert (stream == 0).nonzero().flatten().tolist() == [len(stream) // 2 - 1, len(stream) - 1]
