"""On a CUDA GPU: the budget flood of tests/test_server_budget_flood.py against a server on the GPU
(bf16, CUDA graphs). Besides staying up with unchanged greedy outputs, its GPU memory, as the
caching allocator reports it in /metrics, grows by less than GPU_GROWTH_LIMIT over the 200 budgets
once the working set has held its largest budgets.

Skipped where no GPU is present."""
from __future__ import annotations

import pytest
import torch

from test_server_budget_flood import MB, RSS_GROWTH_LIMIT, flood, flood_server

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Five budgets held at once (the default and four cached), each at most the buffers of a 4096-node
# tree: float32 logits of 4097 rows over the demo vocabulary, the verify's activations and its
# graphs. Without the working set the 200 budgets stayed allocated, each such a set.
GPU_GROWTH_LIMIT = 1024 * MB


def test_200_distinct_budgets_on_a_gpu_leave_gpu_memory_bounded(demo_pair):
    with flood_server(demo_pair, device="cuda") as server:
        figures = flood(server)
    for name, (first, peak, last) in figures.items():
        limit = RSS_GROWTH_LIMIT if name == "rss" else GPU_GROWTH_LIMIT
        assert peak - first < limit and last - first < limit, (name, figures[name])
    assert figures["gpu_reserved"][0] > 0  # the gauges are there on a GPU
