"""Shared by the batched engine's CPU tests: its CUDA graph path run on the CPU."""
from __future__ import annotations


class RunAgain:
    """A CUDA graph's stand-in on the CPU: replaying it runs its function again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        self.fn()


def replayed(engine, monkeypatch):
    """Make `engine` (a `BatchEngine`) take its graph path on the CPU: a capture runs the function
    once, as a capture's warm-up does (a real capture then records it without running it), and
    each replay runs it again."""
    def capture(fn):
        return RunAgain(fn), fn()

    monkeypatch.setattr(engine.rounds, "use_graphs", True)
    monkeypatch.setattr(engine.rounds, "capture", capture)
    return engine


def decode_rows(engine, requests, budgets, join_after: int, after_round=None, sized: bool = False) -> list[list[int]]:
    """requests [(prompt ids, SamplingParams)] with one tree budget each: the first `join_after`
    join, then one more after each round while a row is free; each leaves at its max_tokens.
    after_round(engine) runs after every round (the callers' checks) -> every request's tokens.
    sized: each request's cache region holds its max_tokens and its budget's tree (not the context
    limit), and a request joins only when a region for it is free too."""
    waiting, tokens, index = list(enumerate(requests)), {}, {}

    def size(i):
        prompt, params = requests[i]
        return (params.max_tokens, budgets[i].nodes(engine.block_size)) if sized else (None, None)

    def can_join():
        return bool(waiting) and engine.free_rows and (not sized or engine.fits(len(requests[waiting[0][0]][0]),
                                                                                 *size(waiting[0][0])))

    def join():
        i, (prompt, params) = waiting.pop(0)
        max_new, max_nodes = size(i)
        seq, step = engine.add(prompt, params, budgets[i], max_new=max_new, max_nodes=max_nodes)
        index[id(seq)], tokens[i] = i, list(step.tokens)

    for _ in range(join_after):
        if can_join():
            join()
    while engine.sequences:
        for seq, step in engine.step():
            i = index[id(seq)]
            tokens[i] += step.tokens
            if len(tokens[i]) >= requests[i][1].max_tokens:
                engine.remove(seq)
        if after_round is not None:
            after_round(engine)
        if can_join():
            join()
    assert not waiting, "requests left that never fit"
    return [tokens[i][:params.max_tokens] for i, (_, params) in enumerate(requests)]
