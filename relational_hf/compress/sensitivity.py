"""End-to-end sensitivity of a causal LM to changes of its sublayer outputs: sampled Fisher directions.

For the next-token distributions p_t of a model and a small change e of one sublayer's output (the update an
attention or MLP block adds to the residual stream; e_t at position t), the KL divergence of the changed model from
the original, summed over positions, is to second order

    sum_t KL(p_t || p_t') ~= 1/2 sum_s,t e_s^T F_st e_t,

F the Fisher information of the joint next-token distribution with respect to that output. With labels y sampled
from the model's own distributions at every position and g = d/d(output) sum_t log p_t(y_t), E[g g^T] = F (the
gradients of independent positions are uncorrelated, so one backward pass per sample covers every position). Keeping
the per-token blocks, the estimate used here is

    KL(e) ~= 1/(2K) sum_k sum_t (g_tk . e_t)^2

over K sampled label sets: the change is measured by its effect on the model's output, whatever the layer, so errors
of different layers and kinds share one currency (nats) and a planner can trade them against each other.
`fisher_directions` collects the g's of every layer's two sublayer outputs; `fisher_energy` evaluates the sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .truncation import ordered_cholesky

SITES: tuple[str, ...] = ("attn", "mlp")


def fisher_directions(
    model: nn.Module,
    ids: torch.Tensor,
    *,
    samples: int = 2,
    batch_size: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict[str, torch.Tensor]]:
    """Sampled Fisher directions of every decoder layer's attention and MLP outputs (module docstring).

    model: a causal LM whose `model.layers[i]` have `self_attn` (returning (output, ...)) and `mlp` submodules (the
    relational and Llama layouts); ids: token ids (N, T). For each of `samples` label sets drawn from the model's own
    next-token distributions (seeded by `seed`), the gradient of the summed log-likelihood of the sampled labels with
    respect to each sublayer output. Returns one dict per layer {"attn": (K, N, T, d), "mlp": (K, N, T, d)} in
    `dtype`. The model's parameters get no gradient; its mode and weights are left as they were."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] < 2:
        raise ValueError(f"`ids` must be token ids of shape (N, T) with T >= 2, got {getattr(ids, 'shape', ids)!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"`samples` must be a positive integer, got {samples!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive integer, got {batch_size!r}")
    layers = model.model.layers
    n, t = ids.shape
    d = model.config.hidden_size
    out = [{s: torch.empty(samples, n, t, d, dtype=dtype) for s in SITES} for _ in layers]
    generator = torch.Generator().manual_seed(seed)
    state = {"rows": slice(0, 0), "k": 0}

    def keep(li: int, site: str):
        def store(grad: torch.Tensor) -> None:
            out[li][site][state["k"], state["rows"]] = grad.detach().to(dtype)

        def on_output(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            if y.requires_grad:
                y.register_hook(store)

        return on_output

    handles = []
    for li, layer in enumerate(layers):
        handles.append(layer.self_attn.register_forward_hook(keep(li, "attn")))
        handles.append(layer.mlp.register_forward_hook(keep(li, "mlp")))
    requires = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        embed = model.get_input_embeddings()
        for start in range(0, n, batch_size):
            rows = slice(start, min(n, start + batch_size))
            state["rows"] = rows
            with torch.enable_grad():
                x = embed(ids[rows]).detach().requires_grad_(True)
                logits = model(inputs_embeds=x, use_cache=False).logits[:, :-1].float()
                probs = logits.detach().softmax(-1).reshape(-1, logits.shape[-1])
                for k in range(samples):
                    state["k"] = k
                    labels = torch.multinomial(probs, 1, generator=generator).view(logits.shape[:-1])
                    # -log p summed: the hooks store d(sum log p)/d(output) up to sign, which the squares ignore
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
                    loss.backward(retain_graph=k + 1 < samples)
            del logits, probs, x
    finally:
        for h in handles:
            h.remove()
        for p, r in zip(model.parameters(), requires, strict=True):
            p.requires_grad_(r)
        model.train(was_training)
    return out


def head_label_gradients(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    *,
    samples: int = 2,
    batch_size: int = 2,
    seed: int = 0,
) -> torch.Tensor:
    """The top of `fisher_directions` for a model run one layer at a time: `head` maps the last decoder layer's
    output (B, T, d) to logits (the final norm and the output head); hidden: that output for all N rows (N, T, d).
    Labels are drawn from the model's own next-token distributions exactly as `fisher_directions` draws them (batch
    by batch of `batch_size` rows, then sample by sample, one generator seeded by `seed`). Returns the gradients
    (K, N, T, d) of the summed -log-likelihood of each label set with respect to `hidden` (fp32)."""
    n = hidden.shape[0]
    out = torch.empty(samples, *hidden.shape, dtype=torch.float32, device=hidden.device)
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, n, batch_size):
        rows = slice(start, min(n, start + batch_size))
        with torch.enable_grad():
            x = hidden[rows].detach().float().requires_grad_(True)
            logits = head(x)[:, :-1].float()
            probs = logits.detach().softmax(-1).reshape(-1, logits.shape[-1]).cpu()
            for k in range(samples):
                labels = torch.multinomial(probs, 1, generator=generator).view(logits.shape[:-1]).to(logits.device)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum")
                (out[k, rows],) = torch.autograd.grad(loss, [x], retain_graph=k + 1 < samples)
    return out


def layer_fisher_step(
    layer: nn.Module,
    run: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    grads: torch.Tensor,
    *,
    batch_size: int = 2,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One decoder layer of `fisher_directions`, backwards: `run(layer, h)` is the layer's forward, hidden (N, T, d)
    its input and grads (K, N, T, d) the gradients with respect to its output (from `head_label_gradients` or the
    step of the layer above). Returns the gradients with respect to its input (K, N, T, d, fp32) and the layer's
    Fisher directions {"attn": (K, N, T, d), "mlp": (K, N, T, d)} in `dtype` (the gradients with respect to the
    attention and MLP outputs, what `fisher_directions` stores). The layer's parameters get no gradient."""
    samples, n = grads.shape[0], hidden.shape[0]
    dirs = {s: torch.empty(grads.shape, dtype=dtype) for s in SITES}
    below = torch.empty_like(grads)
    outputs: dict[str, torch.Tensor] = {}

    def keep(site: str):
        def on_output(module, args, output):
            outputs[site] = output[0] if isinstance(output, tuple) else output

        return on_output

    requires = [p.requires_grad for p in layer.parameters()]
    handles = [layer.self_attn.register_forward_hook(keep("attn")), layer.mlp.register_forward_hook(keep("mlp"))]
    try:
        for p in layer.parameters():
            p.requires_grad_(False)
        for start in range(0, n, batch_size):
            rows = slice(start, min(n, start + batch_size))
            with torch.enable_grad():
                x = hidden[rows].detach().float().requires_grad_(True)
                y = run(layer, x)
                for k in range(samples):
                    gx, ga, gm = torch.autograd.grad(
                        y, [x, outputs["attn"], outputs["mlp"]], grads[k, rows], retain_graph=k + 1 < samples
                    )
                    below[k, rows] = gx
                    dirs["attn"][k, rows] = ga.to(dtype).cpu()
                    dirs["mlp"][k, rows] = gm.to(dtype).cpu()
            outputs.clear()
    finally:
        for h in handles:
            h.remove()
        for p, r in zip(layer.parameters(), requires, strict=True):
            p.requires_grad_(r)
    return below, dirs


def fisher_energy(e: torch.Tensor, directions: torch.Tensor) -> float:
    """Predicted KL (nats, summed over tokens) of a change e (N, T, d) of a sublayer output with sampled Fisher
    directions (K, N, T, d) of that output: 1/(2K) sum_k sum_t (g_tk . e_t)^2 (module docstring)."""
    if e.shape != directions.shape[1:]:
        raise ValueError(f"change of shape {tuple(e.shape)} does not match directions {tuple(directions.shape)}")
    proj = torch.einsum("ntd,kntd->knt", e.float(), directions.float())
    return 0.5 * float(proj.double().pow(2).sum()) / directions.shape[0]


def fisher_metric(directions: torch.Tensor, regularisation: float = 1e-2) -> torch.Tensor:
    """The output-space Fisher metric of a site, Q = 1/K sum_k sum_t g_tk g_tk^T (d, d) from directions (K, N, T, d),
    plus `regularisation` x its mean eigenvalue on the diagonal (a few thousand directions in d dimensions estimate
    the large eigenvalues well and the small ones poorly). Q replaces the Euclidean norm where a truncation measures
    its error in the output space (`truncation.vo_truncate`, `truncation.mlp_unit_scores`)."""
    g = directions.reshape(-1, directions.shape[-1]).double()
    q = g.T @ g / directions.shape[0]
    q.diagonal().add_(regularisation * float(torch.diagonal(q).mean()))
    return q


def vo_fisher_errors(
    mixed: torch.Tensor, wo: torch.Tensor, factors: list[tuple], ranks: list[int], directions: torch.Tensor
) -> list[float]:
    """Predicted KL of the rank-r VO truncations of `vo_truncate` for each r in `ranks`, without forming the changed
    outputs: the change is e_t = sum_j o_jt (I - T T') W_O^j (o_jt the mixed values of query head j, (B, T, H, r_v)),
    so g . e_t = sum_j (o_jt (I - T T')) . (W_O^j g_t), and W_O^j g_t is computed once per direction."""
    b, t, h, rv = mixed.shape
    k = directions.shape[0]
    nkv = len(factors)
    g = h // nkv
    # a[k, n, j] = W_O^j g_kt (r_v,) for every query head j
    a = (directions.float().reshape(k, b * t, -1) @ wo.float()).view(k, b * t, h, rv).double()
    o = mixed.reshape(b * t, h, rv).double()
    out = []
    for rank in ranks:
        total = torch.zeros(k, b * t, dtype=torch.float64, device=o.device)
        for kv, (p, u, _, _) in enumerate(factors):
            u_r = u[:, :rank]
            rest = torch.eye(rv, dtype=torch.float64, device=o.device) - torch.linalg.pinv(p, hermitian=True) @ u_r @ u_r.T @ p
            heads = slice(kv * g, (kv + 1) * g)
            total += ((o[:, heads] @ rest).unsqueeze(0) * a[:, :, heads]).sum((-1, -2))
        out.append(0.5 * float(total.pow(2).sum()) / k)
    return out


def mlp_fisher_curve(
    z: torch.Tensor, y: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, order: torch.Tensor | None,
    ridge: float, directions: torch.Tensor,
) -> torch.Tensor:
    """Predicted KL of keeping the first k units of `order` with the refitted W_down of `mlp_refit`, for every
    k = 1..d_ff at once. z: (n, d_ff) unit activations, y: (n, d) the dense MLP output, gram/cross: the (weighted)
    refit statistics Z^T W Z and Z^T W Y, directions (K, n, d). With the Cholesky factor L L^T = G_oo + lam I of the
    Gram in that order, the refit output with k units is Zh[:, :k] P[:k] (Zh = Z_o L^-T, P = L^-1 (Z^T W Y)_o, the
    same factors as `mlp_error_curve`), so g . yhat_k is a cumulative sum over units. Returns (d_ff,) (entry k-1).
    order None: z, gram and cross are already in that order, and gram (float64) is overwritten."""
    chol = ordered_cholesky(gram, order, ridge)
    c, zo = (cross, z) if order is None else (cross[order], z[:, order])
    proj = torch.linalg.solve_triangular(chol, c.double(), upper=False)  # (d_ff, d)
    zh = torch.linalg.solve_triangular(chol, zo.double().T, upper=False).T  # (n, d_ff) = Z_o L^-T
    del chol, zo
    dirs = directions.reshape(directions.shape[0], -1, directions.shape[-1]).double()  # (K, n, d)
    target = (dirs * y.double().unsqueeze(0)).sum(-1)  # (K, n): g . y
    total = torch.zeros(zh.shape[1], dtype=torch.float64, device=zh.device)
    step = max(1, (1 << 23) // max(1, dirs.shape[0] * zh.shape[1]))  # rows per block: (K, rows, d_ff) of 64 MiB
    for start in range(0, zh.shape[0], step):
        rows = slice(start, start + step)
        along = (zh[rows].unsqueeze(0) * (dirs[:, rows] @ proj.T)).cumsum(-1)  # (K, rows, d_ff): g . yhat_k
        total += (along - target[:, rows].unsqueeze(-1)).pow(2).sum((0, 1))
    return 0.5 * total / directions.shape[0]


__all__ = [
    "SITES",
    "fisher_directions",
    "fisher_energy",
    "fisher_metric",
    "head_label_gradients",
    "layer_fisher_step",
    "mlp_fisher_curve",
    "vo_fisher_errors",
]
