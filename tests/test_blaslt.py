"""`ddtree.kernels.blaslt`: projections through the cuBLASLt kernel timed fastest.

On the CPU `linear` is PyTorch's call whatever the switch says; on a GPU every candidate cuBLASLt
offers agrees with PyTorch's product, and a chosen kernel runs the same in eager calls and graphs.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from ddtree.kernels import blaslt


@pytest.fixture(autouse=True)
def own_cache(monkeypatch, tmp_path):
    """Each test with a cache file of its own, read afresh."""
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(blaslt, "_SAVED", None)
    monkeypatch.setattr(blaslt, "_CACHE_FAILED", set())


@pytest.fixture
def enabled(monkeypatch):
    monkeypatch.setattr(blaslt, "ENABLED", True)
    monkeypatch.setattr(blaslt, "_CHOSEN", {})
    return blaslt


@pytest.mark.parametrize("accumulate", [False, True])
def test_cpu_runs_pytorchs_call(enabled, accumulate):
    torch.manual_seed(0)
    x, w = torch.randn(5, 32), torch.randn(24, 32)
    out = torch.randn(5, 24)
    want = out + x @ w.T if accumulate else F.linear(x, w)
    got = enabled.linear(x, w, out=out.clone() if accumulate else None, accumulate=accumulate)
    torch.testing.assert_close(got, want)
    assert enabled.chosen() == []


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("m", [1, 17, 65])
@pytest.mark.parametrize("mode", ["plain", "accumulate", "float32_out"])
def test_every_candidate_matches_pytorch(m, mode):
    torch.manual_seed(0)
    n, k = 768, 512
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    base = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    out_dtype = torch.float32 if mode == "float32_out" else None
    plan = blaslt.LtProjection(m, n, k, torch.bfloat16, accumulate=mode == "accumulate", out_dtype=out_dtype)
    want = (x.float() @ w.float().T) + (base.float() if mode == "accumulate" else 0)
    candidates = plan.candidates()
    assert candidates, "cuBLASLt offered no kernel"
    for cand in candidates:
        y = base.clone() if mode == "accumulate" else torch.empty(m, n, device="cuda", dtype=out_dtype or x.dtype)
        got = plan(x, w, y, cand)
        assert got.data_ptr() == y.data_ptr()
        tol = 2e-2 * want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= tol, cand.label()


@needs_gpu
def test_a_chosen_kernel_runs_the_same_in_a_graph(enabled):
    torch.manual_seed(0)
    m, n, k = 65, 4096, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    eager = enabled.linear(x, w, out=h.clone(), accumulate=True)  # times the candidates here
    assert len(enabled._CHOSEN) == 1
    torch.testing.assert_close(eager.float(), h.float() + x.float() @ w.float().T, atol=0.1, rtol=2e-2)
    out = h.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        enabled.linear(x, w, out=out, accumulate=True)
    out.copy_(h)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert len(enabled._CHOSEN) == 1


@needs_gpu
@pytest.mark.parametrize("accumulate", [False, True])
def test_a_saved_choice_restores_the_same_kernel_in_a_new_process(enabled, monkeypatch, accumulate):
    """A choice timed on this GPU, saved, then restored from the file in a fresh process (the
    in-memory choices and the file's entries dropped) without timing: the same kernel, the same
    output bit for bit."""
    torch.manual_seed(1)
    m, n, k = 65, 4096, 1024
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    h = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    first = enabled.linear(x, w, out=h.clone() if accumulate else None, accumulate=accumulate)
    (key, choice), = enabled._CHOSEN.items()
    assert enabled.cache_path().exists()
    monkeypatch.setattr(enabled, "_CHOSEN", {})
    monkeypatch.setattr(enabled, "_SAVED", None)
    monkeypatch.setattr(enabled, "graph_call_us", lambda fn, **kw: pytest.fail("a saved choice was timed again"))
    again = enabled.linear(x, w, out=h.clone() if accumulate else None, accumulate=accumulate)
    restored = enabled._CHOSEN[key]
    assert (choice is None) == (restored is None)
    if choice is not None:
        assert list(restored.candidate.algo.data) == list(choice.candidate.algo.data)
    assert torch.equal(again, first)


@needs_gpu
def test_a_shape_first_met_in_a_capture_keeps_pytorchs_call(enabled):
    x = torch.randn(9, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = enabled.linear(x, w)
    graph.replay()
    assert list(enabled._CHOSEN.values()) == [None]
    assert torch.equal(enabled.linear(x, w), F.linear(x, w))
    torch.cuda.synchronize()
    assert torch.equal(y, F.linear(x, w))


class _FakePlan:
    """Stands in for `LtProjection` on the CPU: candidate i computes x @ w.T times `scales[i]`."""

    scales = (1.0, 1.0, 1.5, 1.0)

    def __init__(self, m, n, k, dtype, accumulate, device, out_dtype):
        self.accumulate = accumulate

    def candidates(self):
        return [blaslt.Candidate(self.algo(i), 0, 1.0, {"index": i}) for i in range(len(self.scales))]

    @staticmethod
    def algo(index):
        algo = blaslt._Algo()
        algo.data[0] = index
        return algo

    def __call__(self, x, w, y, cand):
        product = (x @ w.T) * self.scales[cand.config["index"]]
        return y.add_(product) if self.accumulate else y.copy_(product)


def _fake_timing(monkeypatch, times):
    """graph_call_us returns `times` in order: PyTorch's call first, then each agreeing candidate."""
    queue = list(times)
    monkeypatch.setattr(blaslt, "graph_call_us", lambda fn, **kw: (fn(0), queue.pop(0))[1])
    monkeypatch.setattr(blaslt, "LtProjection", _FakePlan)
    monkeypatch.setattr(blaslt, "_l2_bytes", lambda device: 1 << 20)
    return queue


@pytest.mark.parametrize("accumulate", [False, True])
def test_choose_takes_the_fastest_candidate_that_agrees(monkeypatch, accumulate):
    # PyTorch 10 us; candidates 0, 1 and 3 agree (2 is off by half) and take 9.5, 8.0 and 8.5 us.
    queue = _fake_timing(monkeypatch, [10.0, 9.5, 8.0, 8.5])
    x, w, out = torch.randn(3, 16), torch.randn(8, 16), torch.randn(3, 8)
    before = out.clone()
    choice = blaslt._choose(x, w, out, accumulate, torch.float32)
    assert queue == []  # the disagreeing candidate was never timed
    assert choice.candidate.config == {"index": 1} and (choice.torch_us, choice.us) == (10.0, 8.0)
    assert torch.equal(out, before)  # the caller's output is not touched while timing


@pytest.mark.parametrize("times", [[10.0, 9.8, 9.9, 9.9], [5.0, 4.8, 4.8, 4.9]])
def test_choose_keeps_pytorch_unless_a_candidate_wins_clearly(monkeypatch, times):
    # 2% faster, or 0.2 us faster: within what two timings of one kernel differ by.
    _fake_timing(monkeypatch, times)
    assert blaslt._choose(torch.randn(3, 16), torch.randn(8, 16), None, False, torch.float32) is None


def test_choose_keeps_pytorch_where_timing_runs_out_of_memory(monkeypatch):
    def no_room(fn, **kw):
        raise torch.OutOfMemoryError("no room")

    _fake_timing(monkeypatch, [])
    monkeypatch.setattr(blaslt, "graph_call_us", no_room)
    assert blaslt._choose(torch.randn(3, 16), torch.randn(8, 16), None, False, torch.float32) is None


@pytest.mark.parametrize("error", [blaslt.CublasLtMissing("libcublasLt was not found beside PyTorch"),
                                   OSError("libcublasLt.so.13: cannot open shared object file")])
def test_a_cublaslt_that_cannot_be_loaded_keeps_pytorchs_call(enabled, monkeypatch, caplog, error):
    """On by default, the choice must not take a server down where cuBLASLt cannot be loaded: the
    shape keeps PyTorch's call, and so does every later one, with one warning."""
    def unloadable(*args, **kw):
        raise error

    monkeypatch.setattr(blaslt, "time_candidates", unloadable)
    monkeypatch.setattr(blaslt, "_build", unloadable)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with caplog.at_level("WARNING", logger="ddtree.blaslt"):
        assert blaslt._choice_for((3, 8, 16, x.dtype, torch.float32, False, 0), x, w, None, False,
                                  torch.float32) is None
    assert blaslt.ENABLED is False
    assert [r.message for r in caplog.records if "PyTorch's call" in r.message] == [
        f"cuBLASLt could not be loaded ({error}): every projection keeps PyTorch's call"]


def test_a_shape_cuBLASLt_cannot_plan_keeps_pytorchs_call(enabled, monkeypatch, caplog):
    """A shape whose plan or timing fails (a cuBLAS status) keeps PyTorch's call, with a warning;
    the choice stays on for other shapes."""
    def no_plan(*args, **kw):
        raise RuntimeError("cublasLtMatmulAlgoGetHeuristic failed with cublasStatus 15")

    monkeypatch.setattr(blaslt, "time_candidates", no_plan)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with caplog.at_level("WARNING", logger="ddtree.blaslt"):
        assert blaslt._choose(x, w, None, False, torch.float32) is None
    assert blaslt.ENABLED is True
    assert any("could not be timed" in r.message and "cublasStatus 15" in r.message for r in caplog.records)


def test_the_op_traces_whole_inside_a_compiled_function(enabled):
    """`blaslt_linear` is what `linear` becomes inside a `torch.compile`d function on a GPU (the
    drafter's layers): one opaque op with a shape rule, no graph break (fullgraph), PyTorch's
    product where no kernel was chosen."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 32), torch.randn(24, 32)
    torch.library.opcheck(torch.ops.ddtree.blaslt_linear.default, (x, w, False))
    fn = torch.compile(lambda x, w: torch.ops.ddtree.blaslt_linear(x, w, False).relu(), backend="aot_eager",
                       fullgraph=True, dynamic=True)
    torch.testing.assert_close(fn(x, w), F.linear(x, w).relu())
    torch.testing.assert_close(fn(x[:3], w), F.linear(x[:3], w).relu())


def test_training_keeps_pytorchs_call(enabled, monkeypatch):
    """Gradients flow: a projection whose inputs need them never goes through cuBLASLt's call."""
    monkeypatch.setattr(blaslt, "_linear", lambda *a: pytest.fail("cuBLASLt's path taken while training"))
    x, w = torch.randn(3, 16), torch.randn(8, 16, requires_grad=True)
    enabled.linear(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.sum(0).expand(8, 16))


KEY = (3, 8, 16, torch.float32, torch.float32, False, 0)


def _cached_setup(monkeypatch, times):
    """`_choice_for` on the CPU: a fake cuBLASLt build name, the fake plan (a restored algorithm's
    first word its candidate's index) and timings."""
    queue = _fake_timing(monkeypatch, times)
    monkeypatch.setattr(blaslt, "_build", lambda device: "FakeGPU|cublasLt 1")
    monkeypatch.setattr(blaslt, "_describe", lambda algo: {"index": int(algo.data[0])})
    return queue


def test_a_choice_is_saved_and_restored_at_the_next_start(monkeypatch):
    """The first start times the shape and writes its choice; a fresh process (the file read
    again) restores it without timing; the file names the GPU, the cuBLASLt build and the shape."""
    queue = _cached_setup(monkeypatch, [10.0, 9.5, 8.0, 8.5])
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    first = blaslt._choice_for(KEY, x, w, None, False, torch.float32)
    assert queue == [] and first.us == 8.0
    record = json.loads(blaslt.cache_path().read_text())
    name = "FakeGPU|cublasLt 1|3x8x16|float32->float32|="
    assert record["format"] == blaslt.CACHE_FORMAT and set(record["choices"]) == {name}
    assert record["choices"][name]["us"] == 8.0 and len(record["choices"][name]["algo"]) == 8
    monkeypatch.setattr(blaslt, "_SAVED", None)  # a new process
    monkeypatch.setattr(blaslt, "graph_call_us", lambda fn, **kw: pytest.fail("a saved choice was timed again"))
    again = blaslt._choice_for(KEY, x, w, None, False, torch.float32)
    assert (again.us, again.torch_us) == (8.0, 10.0)
    assert list(again.candidate.algo.data) == list(first.candidate.algo.data)


def test_pytorchs_call_kept_is_saved_too(monkeypatch):
    _cached_setup(monkeypatch, [10.0, 9.8, 9.9, 9.9])
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert blaslt._choice_for(KEY, x, w, None, False, torch.float32) is None
    monkeypatch.setattr(blaslt, "_SAVED", None)
    monkeypatch.setattr(blaslt, "graph_call_us", lambda fn, **kw: pytest.fail("timed again"))
    assert blaslt._choice_for(KEY, x, w, None, False, torch.float32) is None
    other = (KEY[0] + 1,) + KEY[1:]  # another shape is not in the file
    with pytest.raises(pytest.fail.Exception):
        blaslt._choice_for(other, torch.randn(4, 16), w, None, False, torch.float32)


def test_a_saved_kernel_that_disagrees_is_timed_again(monkeypatch):
    name = "FakeGPU|cublasLt 1|3x8x16|float32->float32|="
    blaslt.cache_path().parent.mkdir(parents=True)
    blaslt.cache_path().write_text(json.dumps({"format": blaslt.CACHE_FORMAT, "choices": {
        name: {"algo": [2] + [0] * 7, "workspace": 0, "us": 1.0, "torch_us": 10.0},  # the fake's 1.5x kernel
        "OtherGPU|cublasLt 1|3x8x16|float32->float32|=": None}}))
    queue = _cached_setup(monkeypatch, [10.0, 9.5, 8.0, 8.5])
    choice = blaslt._choice_for(KEY, torch.randn(3, 16), torch.randn(8, 16), None, False, torch.float32)
    assert queue == [] and choice.us == 8.0
    choices = json.loads(blaslt.cache_path().read_text())["choices"]
    assert choices[name]["us"] == 8.0 and "OtherGPU|cublasLt 1|3x8x16|float32->float32|=" in choices


def _walk_finds(monkeypatch, found_index: int, seen: dict):
    """The configurations' walk (`_searched`) on the CPU: it finds the fake's candidate `found_index`."""
    def searched(plan, heuristic, x, weights, scratch, seconds):
        seen.update(bases=len(heuristic), seconds=seconds)
        return [blaslt.Candidate(_FakePlan.algo(found_index), 0, 1.0, {"index": found_index})]

    monkeypatch.setattr(blaslt, "_searched", searched)


def test_the_walk_times_its_finds_beside_the_heuristics_and_its_choice_is_kept(monkeypatch):
    """A choice saved without the walk is timed again with it on, the walk's find beside the
    heuristic's four; the walk's choice is saved as such and a start without the walk restores it."""
    name = "FakeGPU|cublasLt 1|3x8x16|float32->float32|="
    blaslt.cache_path().parent.mkdir(parents=True)
    blaslt.cache_path().write_text(json.dumps({"format": blaslt.CACHE_FORMAT, "choices": {
        name: {"algo": [1] + [0] * 7, "workspace": 0, "us": 8.0, "torch_us": 10.0}}}))
    queue = _cached_setup(monkeypatch, [10.0, 9.5, 8.0, 8.5, 7.0])
    seen = {}
    _walk_finds(monkeypatch, 3, seen)
    monkeypatch.setattr(blaslt, "SEARCH_SECONDS", 2.0)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    choice = blaslt._choice_for(KEY, x, w, None, False, torch.float32)
    assert queue == [] and seen == {"bases": 4, "seconds": 2.0} and choice.us == 7.0
    entry = json.loads(blaslt.cache_path().read_text())["choices"][name]
    assert entry["searched"] is True and entry["us"] == 7.0 and entry["algo"][0] == 3
    for seconds in (0.0, 2.0):  # restored, not timed, with the walk off and on
        monkeypatch.setattr(blaslt, "SEARCH_SECONDS", seconds)
        monkeypatch.setattr(blaslt, "_SAVED", None)
        monkeypatch.setattr(blaslt, "graph_call_us", lambda fn, **kw: pytest.fail("timed again"))
        assert blaslt._choice_for(KEY, x, w, None, False, torch.float32).us == 7.0


def test_pytorchs_call_kept_with_the_walk_is_restored_as_such(monkeypatch):
    _cached_setup(monkeypatch, [10.0, 9.8, 9.9, 9.9, 9.9])
    _walk_finds(monkeypatch, 3, {})
    monkeypatch.setattr(blaslt, "SEARCH_SECONDS", 2.0)
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    assert blaslt._choice_for(KEY, x, w, None, False, torch.float32) is None
    entry = json.loads(blaslt.cache_path().read_text())["choices"]["FakeGPU|cublasLt 1|3x8x16|float32->float32|="]
    assert entry == {"torch": True, "searched": True}
    for seconds in (0.0, 2.0):
        monkeypatch.setattr(blaslt, "SEARCH_SECONDS", seconds)
        monkeypatch.setattr(blaslt, "_SAVED", None)
        monkeypatch.setattr(blaslt, "graph_call_us", lambda fn, **kw: pytest.fail("timed again"))
        assert blaslt._choice_for(KEY, x, w, None, False, torch.float32) is None


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": "something else", "choices": {"a": 1}})])
def test_an_unreadable_or_foreign_cache_is_timed_over(monkeypatch, content, caplog):
    blaslt.cache_path().parent.mkdir(parents=True)
    blaslt.cache_path().write_text(content)
    queue = _cached_setup(monkeypatch, [10.0, 9.5, 8.0, 8.5])
    assert blaslt._choice_for(KEY, torch.randn(3, 16), torch.randn(8, 16), None, False, torch.float32).us == 8.0
    assert queue == []
    assert json.loads(blaslt.cache_path().read_text())["format"] == blaslt.CACHE_FORMAT
    assert ("could not read" in caplog.text) == (content == "not json")


def test_a_cache_that_cannot_be_written_is_logged_once(monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(blocker / "below"))  # a directory under a file
    _cached_setup(monkeypatch, [10.0, 9.5, 8.0, 8.5, 10.0, 9.5, 8.0, 8.5])
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with caplog.at_level("WARNING", logger="ddtree.blaslt"):
        assert blaslt._choice_for(KEY, x, w, None, False, torch.float32).us == 8.0
        other = (4,) + KEY[1:]
        assert blaslt._choice_for(other, torch.randn(4, 16), w, None, False, torch.float32).us == 8.0
    assert sum("could not write" in r.message for r in caplog.records) == 1


def test_no_room_to_time_is_not_saved(monkeypatch):
    """A shape the GPU had no memory to time keeps PyTorch's call this time, and is not written
    down as decided: the next start times it."""
    _cached_setup(monkeypatch, [])

    def no_room(fn, **kw):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(blaslt, "graph_call_us", no_room)
    assert blaslt._choice_for(KEY, torch.randn(3, 16), torch.randn(8, 16), None, False, torch.float32) is None
    assert not blaslt.cache_path().exists()
