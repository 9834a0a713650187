"""Tree budgets given as text: "ar", "chain" or plain ASCII digits, nothing int() would also take."""
from __future__ import annotations

import pytest

from ddtree.config import MAX_TREE_BUDGET, DDTreeError, parse_tree_budget, shown


@pytest.mark.parametrize("text, budget", [("64", 64), (" 64 ", 64), ("0064", 64), ("AR", "ar"), ("chain", "chain"),
                                          (str(MAX_TREE_BUDGET), MAX_TREE_BUDGET), (7.0, 7), (5, 5)])
def test_accepted(text, budget):
    assert parse_tree_budget(text) == budget


@pytest.mark.parametrize("text", ["1_000", "+5", "-5", "\u0661\u0662", "\uff15", "1e3", "0x10", "5.", "", "6 4",
                                  "9" * 5000, str(MAX_TREE_BUDGET + 1), "0", True, None, 2.5, float("inf")])
def test_refused(text):
    with pytest.raises(DDTreeError) as info:
        parse_tree_budget(text)
    assert info.value.param == "tree_budget" and len(str(info.value)) < 200


def test_shown_cuts_huge_values_without_building_them():
    assert len(shown("x" * 10**7)) <= 80 and len(shown(list(range(10**6)))) <= 80 and shown(1.5) == "1.5"
