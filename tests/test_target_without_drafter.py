"""A target given without a drafter decodes plainly (`ar`) with one warning line, as a vLLM server
does without a speculative config; it is never paired with the demo drafter, which was trained
for the demo target alone. A tree budget that needs a drafter is refused in one line."""
from __future__ import annotations

import argparse
import json
import logging
import shutil

import pytest

from ddtree.cli import main
from ddtree.config import DDTreeError
from ddtree.llm import DEFAULT_DRAFT, LLM
from ddtree.model_pair import default_drafter
from ddtree.tree_shape import AR
from tiny_models import make_target

WARNING = "no drafter given for target"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("lone") / "target"
    make_target(path, "qwen3", max_positions=64)
    return path


def test_generate_decodes_with_ar_and_warns_once(target, capsys):
    code = main(["generate", "--target", str(target), "--device", "cpu", "--prompt-token-ids", "3,4,5",
                 "--max-tokens", "6", "--ignore-eos", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert err.splitlines() == [f"ddtree: warning: {WARNING} {target}: decoding without speculation "
                                f"(tree budget 'ar'); name a DFlash drafter (--draft DIR) to use DDTree"]
    stats = json.loads(out)["stats"]
    assert stats["tree_budget"] == "ar" and set(stats["acceptance_lengths"]) == {1}


def test_generate_with_ar_asked_for_says_nothing(target, capsys):
    code = main(["generate", "--target", str(target), "--device", "cpu", "--prompt-token-ids", "3,4",
                 "--max-tokens", "2", "--tree-budget", "ar", "--json"])
    assert code == 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("budget", ["chain", "16"])
def test_generate_refuses_a_tree_without_a_drafter(target, capsys, budget):
    code = main(["generate", "--target", str(target), "--device", "cpu", "--prompt-token-ids", "3",
                 "--tree-budget", budget])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.splitlines() == [f"ddtree: error: tree budget {budget} needs a drafter: pass --draft DIR (the demo "
                                f"drafter only pairs with the demo target), or use tree budget 'ar'"]


def test_python_api_loads_no_drafter_and_logs_why(target, caplog):
    with caplog.at_level(logging.WARNING, logger="ddtree"):
        llm = LLM(target, device="cpu")
    assert llm.drafter is None and llm.draft_path is None and llm.default_budget == AR
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"{WARNING} {target}"]
    with pytest.raises(DDTreeError, match="tree budget 64 needs a drafter"):
        LLM(target, device="cpu", tree_budget=64)


def test_the_demo_target_still_gets_the_demo_drafter(demo_pair, tmp_path):
    if demo_pair[1] != DEFAULT_DRAFT:
        pytest.skip("the demo pair is not shipped in this checkout")
    assert default_drafter(None) == DEFAULT_DRAFT
    assert default_drafter(demo_pair[0]) == DEFAULT_DRAFT
    assert default_drafter(str(demo_pair[0]) + "/") == DEFAULT_DRAFT
    copy = tmp_path / "my-target"
    shutil.copytree(demo_pair[0], copy)
    assert default_drafter(copy) is None, "another folder is another target, even with the same weights"


def test_serve_loads_the_target_alone_with_a_logged_warning(target, caplog):
    from ddtree.server.main import _load

    args = argparse.Namespace(target=target, draft=None, device="cpu", dtype=None, max_model_len=None)
    with caplog.at_level(logging.WARNING, logger="ddtree"):
        llm = _load(args, None)
    assert llm.drafter is None and llm.default_budget == AR
    assert sum(WARNING in r.getMessage() for r in caplog.records) == 1
