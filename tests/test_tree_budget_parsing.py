"""Tree budgets given as text: "ar", "chain" or plain ASCII digits, nothing int() would also take."""
from __future__ import annotations

import pytest

from ddtree.config import MAX_TREE_BUDGET, DDTreeError, parse_tree_budget, shown
from ddtree.tree_shape import AR, CHAIN, TreeShape


@pytest.mark.parametrize("text, budget", [("64", 64), (" 64 ", 64), ("0064", 64), ("AR", "ar"), ("chain", "chain"),
                                          (str(MAX_TREE_BUDGET), MAX_TREE_BUDGET), (7.0, 7), (5, 5)])
def test_accepted(text, budget):
    shape = parse_tree_budget(text)
    assert shape.json_value == budget and shape.label == str(budget) and parse_tree_budget(shape) is shape


def test_auto_is_a_word_only_where_allowed():
    assert parse_tree_budget(" Auto ", allow_auto=True) == "auto"
    with pytest.raises(DDTreeError, match="'ar', 'chain' or an integer"):
        parse_tree_budget("auto")


def test_shapes_answer_for_themselves():
    best = TreeShape.best(64)
    assert best == parse_tree_budget("64") and len({best, TreeShape.best(64), AR, CHAIN}) == 3
    assert [s.nodes(16) for s in (AR, CHAIN, best)] == [1, 16, 65]
    assert [(s.drafts, s.builds_tree, s.single_node) for s in (AR, CHAIN, best)] == \
        [(False, False, True), (True, False, False), (True, True, False)]
    assert [s.drafted_tokens(16, 1000) for s in (AR, CHAIN, best)] == [0, 15, 64]
    assert TreeShape.best(4096).drafted_tokens(4, 2) == 6  # capped by the prefixes a block can hold
    assert f"{AR} {CHAIN} {best}" == "ar chain 64"
    with pytest.raises(ValueError):
        TreeShape.best(0)


@pytest.mark.parametrize("text", ["1_000", "+5", "-5", "\u0661\u0662", "\uff15", "1e3", "0x10", "5.", "", "6 4",
                                  "9" * 5000, str(MAX_TREE_BUDGET + 1), "0", True, None, 2.5, float("inf")])
def test_refused(text):
    with pytest.raises(DDTreeError) as info:
        parse_tree_budget(text)
    assert info.value.param == "tree_budget" and len(str(info.value)) < 200


def test_shown_cuts_huge_values_without_building_them():
    assert len(shown("x" * 10**7)) <= 80 and len(shown(list(range(10**6)))) <= 80 and shown(1.5) == "1.5"
