"""The gated delta rule (Gated DeltaNet's recurrence) in PyTorch: the reference for the Triton
kernels in `ddtree.kernels.gdn_tree`, and the path on CPUs.

Per value head, with state S [Dk, Dv] (float32), unit-norm key k, scaled unit-norm query q, value
v, log-decay g <= 0 and write strength beta in (0, 1), one token does

    S <- exp(g) S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

Value head h reads key / query head h // (Hv / Hk) (grouped value heads, as transformers'
`repeat_interleave`).

Three forms, all exact rewrites of that loop:
- `recurrent_gated_delta`: the loop itself, for a few tokens (a decode step, a round's commit).
- `chunked_gated_delta`: the chunked (WY / UT) form over a causal sequence (prefill).
- `tree_gated_delta`: the chunked form over a tree in one block: the causal mask becomes the
  ancestor mask and the cumulative log-decay is summed along each node's root path, so node i's
  output equals running its root-to-i path through the loop from S (cross-branch terms vanish).
  It reads the state and writes none (the verify of a round).

Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] float32. q and k
arrive L2-normalised, q already scaled by Dk ** -0.5 (`normalize_qk`). Outputs [T, Hv, Dv] float32.
"""
from __future__ import annotations

import torch

L2_EPS = 1e-6  # as flash-linear-attention and transformers' l2norm


def normalize_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] -> float32 L2-normalised (q also scaled by Dk ** -0.5)."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    return q * q.shape[-1] ** -0.5, k


def _heads_first(q, k, v, g, beta):
    """-> float32 q, k [Hv, T, Dk] (key heads repeated for their value heads), v [Hv, T, Dv], g, beta [Hv, T]."""
    group = v.shape[1] // k.shape[1]
    q = q.float().repeat_interleave(group, dim=1).transpose(0, 1)
    k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    return q, k, v.float().transpose(0, 1), g.float().t(), beta.float().t()


def _block(q, k, v, g, beta, visible, state):
    """One block in the chunked form, heads first (q, k [H, T, Dk], v [H, T, Dv], g, beta [H, T],
    visible [T, T] bool: j is i's ancestor or i itself) -> (o [H, T, Dv], u [H, T, Dv], G [H, T])."""
    t = q.shape[1]
    cum = visible.float()
    G = g @ cum.t()  # [H, T]: the log-decay summed along each node's path, the node's own included
    diff = G[:, :, None] - G[:, None, :]  # <= 0 where j is on i's path
    decay = diff.masked_fill(~visible, float("-inf")).exp()
    eye = torch.eye(t, dtype=torch.bool, device=q.device)
    # (I + A) u = beta (v - exp(G) k S), with A[i, j] = beta_i exp(G_i - G_j) k_i . k_j over strict ancestors j.
    system = (beta[:, :, None] * (k @ k.transpose(1, 2)) * decay).masked_fill(eye, 0.0)
    system = system + torch.eye(t, dtype=system.dtype, device=system.device)
    rhs = beta[:, :, None] * (v - G.exp()[:, :, None] * (k @ state))
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = G.exp()[:, :, None] * (q @ state) + ((q @ k.transpose(1, 2)) * decay) @ u
    return o, u, G


def tree_gated_delta(q, k, v, g, beta, visible: torch.Tensor, state: torch.Tensor,
                     u_out: torch.Tensor | None = None) -> torch.Tensor:
    """Every node of a tree from the committed state; writes no state. visible [N, N] bool is the
    ancestor-or-self mask with nodes in topological order (parents first: lower-triangular).
    u_out [Hv, N, Dv] float32, if given, receives each node's new value u (what `fold_path` needs).
    -> o [N, Hv, Dv] float32."""
    qh, kh, vh, gh, bh = _heads_first(q, k, v, g, beta)
    o, u, _ = _block(qh, kh, vh, gh, bh, visible, state.float())
    if u_out is not None:
        u_out.copy_(u)
    return o.transpose(0, 1)


def path_decay(g: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """g [N, Hv] -> G [N, Hv] float32: each node's log-decay summed along its root path.

    Eagerly a matrix product. Traced by torch.compile (the verify's glue, `hybrid.gdn_tree_inputs`),
    a masked sum over the ancestors, which Inductor makes one small reduction kernel writing where
    G goes; a float32 product is a cast of the mask, a GEMM without tensor cores and a split-K
    reduction. Not eagerly: there the sum would materialise [N, N, Hv] (200 MB at N = 1025, Hv =
    48). Both add the same terms (the others are exact zeros), in different orders."""
    if torch.compiler.is_compiling():
        return torch.where(visible[:, :, None], g.float()[None], 0.0).sum(1)
    return visible.float() @ g.float()


def fold_path(state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, G: torch.Tensor, order: torch.Tensor,
              length: torch.Tensor) -> None:
    """Advance the states of every layer by one root path of a verified tree, in place:

        S <- exp(G_last) S + sum_j exp(G_last - G_j) k_j u_j^T   over the path's nodes j

    which is the token loop run along the path (u_j, the delta rule's new value, depends only on
    j's ancestors, so the tree's u is the path's). state [L, Hv, Dk, Dv] float32; per layer and
    node the stash of the verify: k [L, N, Hk, Dk] (normalised), u [L, Hv, N, Dv], G [L, N, Hv];
    order [M]: the path's nodes, root first, of which the first `length` ([] long) are real; a
    length of 0 leaves the states as they are (a batch's padding rows)."""
    layers, hv = state.shape[0], state.shape[1]
    m = order.shape[0]
    live = torch.arange(m, device=order.device) < length  # [M]
    keys = k.index_select(1, order).float().repeat_interleave(hv // k.shape[2], dim=2)  # [L, M, Hv, Dk]
    values = u.index_select(2, order)  # [L, Hv, M, Dv]
    decay = G.index_select(1, order)  # [L, M, Hv]
    last_index = (length.reshape(1, 1, 1) - 1).clamp(min=0).expand(layers, 1, hv)
    last = decay.gather(1, last_index) * (length > 0)  # [L, 1, Hv]; 0 (no decay) for an empty path
    # Rows past the path are stale nodes whose decay may exceed the last node's: mask before exp.
    weight = (last - decay).masked_fill(~live[None, :, None], float("-inf")).exp()
    state.mul_(last[:, 0, :, None, None].exp())
    state.add_(torch.einsum("lmhd,lmh,lhme->lhde", keys, weight, values))


def _mask_tail(g, beta, length):
    """Rows t >= length leave the state unchanged (decay 1, write strength 0)."""
    if length is None:
        return g, beta
    live = torch.arange(g.shape[0], device=g.device) < length
    return g.float() * live[:, None], beta.float() * live[:, None]


def chunked_gated_delta(q, k, v, g, beta, state: torch.Tensor, length: torch.Tensor | int | None = None,
                        chunk: int = 64) -> torch.Tensor:
    """A causal sequence from `state`, which is updated in place to the state after the first
    `length` tokens (all when None; rows past it are padding). -> o [T, Hv, Dv] float32."""
    g, beta = _mask_tail(g, beta, length)
    qh, kh, vh, gh, bh = _heads_first(q, k, v, g, beta)
    s = state.float()
    outs = []
    for start in range(0, qh.shape[1], chunk):
        sl = slice(start, start + chunk)
        t = qh[:, sl].shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        o, u, G = _block(qh[:, sl], kh[:, sl], vh[:, sl], gh[:, sl], bh[:, sl], causal, s)
        outs.append(o)
        last = G[:, -1:]
        s = s * last.exp()[:, :, None] + (kh[:, sl] * (last - G).exp()[:, :, None]).transpose(1, 2) @ u
    state.copy_(s)
    return torch.cat(outs, dim=1).transpose(0, 1)


def recurrent_gated_delta(q, k, v, g, beta, state: torch.Tensor,
                          length: torch.Tensor | int | None = None) -> torch.Tensor:
    """The token loop from `state`, updated in place to the state after the first `length` tokens.
    -> o [T, Hv, Dv] float32."""
    g, beta = _mask_tail(g, beta, length)
    qh, kh, vh, gh, bh = _heads_first(q, k, v, g, beta)
    s = state.float()
    outs = []
    for t in range(qh.shape[1]):
        s = s * gh[:, t].exp()[:, None, None]
        delta = bh[:, t, None] * (vh[:, t] - (s * kh[:, t, :, None]).sum(1))  # [H, Dv]
        s = s + kh[:, t, :, None] * delta[:, None, :]
        outs.append((s * qh[:, t, :, None]).sum(1))
    state.copy_(s)
    return torch.stack(outs, dim=1).transpose(0, 1)
