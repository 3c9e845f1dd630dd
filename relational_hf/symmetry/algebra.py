"""Lie subalgebras of gl(n) acting on head coordinates, and the small linear solves of DESIGN.md 2.2-2.3.

Notation: per head, factors in the row-vector convention, e.g. W_Q (d x r), W_K (d x r) with G_QK = W_Q W_K^T.
A group element A acts as W_Q -> W_Q A, W_K -> W_K A^-T; its Lie algebra element X as xi(X) = (W_Q X, -W_K X^T).
Every subalgebra below is closed under transposition, so the balance W_Q^T W_Q - W_K^T W_K projected onto it is a
conserved quantity of gradient flow.

Everything is batched over leading dimensions (heads); factorisations run in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modeling.modeling_gauge import max_volume_rows

#: relative regulariser added to the Gram eigenvalues (keeps rank-deficient heads finite)
DEFAULT_EPS = 1e-9


def symmetric_eigh(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a batch of symmetric PSD matrices in float64, eigenvalues clamped at 0."""
    m64 = m.double()
    evals, evecs = torch.linalg.eigh(0.5 * (m64 + m64.transpose(-1, -2)))
    return evals.clamp_min(0.0), evecs


def _regulariser(scale: torch.Tensor, eps: float) -> torch.Tensor:
    return eps * scale + torch.finfo(torch.float64).tiny


def sylvester_factor(
    s_eig: tuple[torch.Tensor, torch.Tensor], t_eig: tuple[torch.Tensor, torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `sylvester_apply` needs for repeated solves of S X + X T = Y: (U, V^T, V, the denominators)."""
    (ls, us), (lt, ut) = s_eig, t_eig
    scale = ls.mean(-1) + lt.mean(-1)  # (...)
    denom = ls[..., :, None] + lt[..., None, :] + _regulariser(scale, eps)[..., None, None]
    return us, ut.transpose(-1, -2), ut, denom


def sylvester_apply(
    factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], y: torch.Tensor
) -> torch.Tensor:
    """X with S X + X T = Y, for symmetric PSD S (..., n, n), T (..., m, m) given by `sylvester_factor` of their
    eigendecompositions S = U diag(l) U^T, T = V diag(m) V^T: X = U [(U^T Y V)_ij / (l_i + m_j + eps')] V^T,
    eps' = eps (tr S/n + tr T/m)."""
    us, ut_t, ut, denom = factors
    inner = us.transpose(-1, -2) @ y.double() @ ut
    return us @ (inner / denom) @ ut_t


def lyapunov_factor(
    c_eig: tuple[torch.Tensor, torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `lyapunov_apply` needs for repeated solves of (C Omega + Omega C) / 2 = Y: (U, U^T, the denominators)."""
    lc, uc = c_eig
    denom = lc[..., :, None] + lc[..., None, :] + _regulariser(2 * lc.mean(-1), eps)[..., None, None]
    return uc, uc.transpose(-1, -2), denom


def lyapunov_apply(factors: tuple[torch.Tensor, torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """Skew Omega with (C Omega + Omega C) / 2 = Y for a skew Y and symmetric PSD C = U diag(c) U^T given by
    `lyapunov_factor`: Omega = U [2 (U^T Y U)_ij / (c_i + c_j + eps')] U^T."""
    uc, uc_t, denom = factors
    return uc @ (2 * (uc_t @ y.double() @ uc) / denom) @ uc_t


def skew(m: torch.Tensor) -> torch.Tensor:
    """(M - M^T) / 2."""
    return 0.5 * (m - m.transpose(-1, -2))


class Subalgebra:
    """A subalgebra h of gl(n), represented inside gl(n) (so elements are n x n matrices)."""

    n: int

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """Frobenius-orthogonal projection of Y (..., n, n) onto h."""
        raise NotImplementedError

    def dimension(self) -> int:
        raise NotImplementedError

    def factor(self, s: torch.Tensor, t: torch.Tensor, eps: float) -> object:
        """Factorise the Gram operator X -> project(S X + X T) on h for symmetric PSD S, T (batched)."""
        raise NotImplementedError

    def solve(self, factors: object, y: torch.Tensor) -> torch.Tensor:
        """X in h with project(S X + X T) = Y for Y in h, from `factor`'s result (eps-regularised)."""
        raise NotImplementedError

    def random(self, batch: tuple[int, ...], generator: torch.Generator, scale: float) -> torch.Tensor:
        """A random element of h (normal entries of size `scale`, projected), float64."""
        x = torch.randn(*batch, self.n, self.n, generator=generator, dtype=torch.float64) * scale
        return self.project(x)


class FullLinear(Subalgebra):
    """gl(n): the full QK or VO gauge (no rotary positions), dimension n^2."""

    def __init__(self, n: int) -> None:
        self.n = n

    def project(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def dimension(self) -> int:
        return self.n * self.n

    def factor(self, s: torch.Tensor, t: torch.Tensor, eps: float) -> object:
        return sylvester_factor(symmetric_eigh(s), symmetric_eigh(t), eps)

    def solve(self, factors: object, y: torch.Tensor) -> torch.Tensor:
        return sylvester_apply(factors, y)


class RotaryCommutant(Subalgebra):
    """Matrices commuting with every RoPE rotation on the first `rotary_dim` coordinates (pairs (j, j + R/2), the
    rotate-half convention): per pair a complex scalar [[a, b], [-b, a]]; on the n - R coordinates RoPE leaves alone,
    the full gl(n - R) (partial rotary). Dimension 2 (R/2) + (n - R)^2 = R + (n - R)^2.

    `pair_mask` keeps only some pairs and `scalings=False` keeps only their rotation part b (the case of a QK-norm,
    whose normalisation admits rotations only, on the pairs where the norm gains are equal); `pass_block=False`
    drops the gl(n - R) block."""

    def __init__(
        self,
        n: int,
        rotary_dim: int,
        pair_mask: torch.Tensor | None = None,
        scalings: bool = True,
        pass_block: bool = True,
    ) -> None:
        if rotary_dim % 2 or rotary_dim > n:
            raise ValueError(f"rotary_dim must be even and <= {n}, got {rotary_dim}")
        self.n, self.rotary_dim, self.half = n, rotary_dim, rotary_dim // 2
        self.pair_mask = torch.ones(self.half, dtype=torch.bool) if pair_mask is None else pair_mask.bool().cpu()
        self.scalings, self.pass_block = scalings, pass_block
        j = torch.arange(self.half)
        self._j, self._k = j[self.pair_mask], j[self.pair_mask] + self.half

    def dimension(self) -> int:
        pairs = int(self.pair_mask.sum()) * (2 if self.scalings else 1)
        return pairs + ((self.n - self.rotary_dim) ** 2 if self.pass_block else 0)

    def pair_coefficients(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, b) of the projection onto the active pairs: a = (y_jj + y_kk)/2, b = (y_jk - y_kj)/2, each (..., P)."""
        j, k = self._j.to(y.device), self._k.to(y.device)
        a = 0.5 * (y[..., j, j] + y[..., k, k])
        b = 0.5 * (y[..., j, k] - y[..., k, j])
        return (a if self.scalings else torch.zeros_like(a)), b

    def from_pairs(self, a: torch.Tensor, b: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(like)
        j, k = self._j.to(like.device), self._k.to(like.device)
        out[..., j, j] = a
        out[..., k, k] = a
        out[..., j, k] = b
        out[..., k, j] = -b
        return out

    def project(self, y: torch.Tensor) -> torch.Tensor:
        out = self.from_pairs(*self.pair_coefficients(y), like=y)
        if self.pass_block and self.rotary_dim < self.n:
            r = self.rotary_dim
            out[..., r:, r:] = y[..., r:, r:]
        return out

    def factor(self, s: torch.Tensor, t: torch.Tensor, eps: float) -> object:
        # The Gram of xi on this algebra is block diagonal: per pair (tr S_jj + tr T_jj)/2 times the identity
        # (on both the scaling and the rotation direction), and a Sylvester operator on the pass block.
        s64, t64 = s.double(), t.double()
        j, k = self._j.to(s.device), self._k.to(s.device)
        trace = s64[..., j, j] + s64[..., k, k] + t64[..., j, j] + t64[..., k, k]  # (..., P)
        scale = torch.diagonal(s64, dim1=-2, dim2=-1).mean(-1) + torch.diagonal(t64, dim1=-2, dim2=-1).mean(-1)
        denom = 0.5 * trace + _regulariser(scale, eps)[..., None]
        passing = None
        if self.pass_block and self.rotary_dim < self.n:
            r = self.rotary_dim
            passing = sylvester_factor(symmetric_eigh(s64[..., r:, r:]), symmetric_eigh(t64[..., r:, r:]), eps)
        return denom, passing

    def solve(self, factors: object, y: torch.Tensor) -> torch.Tensor:
        denom, passing = factors
        y64 = y.double()
        a, b = self.pair_coefficients(y64)
        out = self.from_pairs(a / denom, b / denom, like=y64)
        if passing is not None:
            r = self.rotary_dim
            out[..., r:, r:] = sylvester_apply(passing, y64[..., r:, r:])
        return out


class Conformal(Subalgebra):
    """co(n) = scalars + skew matrices: the VO gauge left by value-space parallel removal, which commutes only with
    maps preserving angles (B = s O). Dimension 1 + n(n-1)/2."""

    def __init__(self, n: int) -> None:
        self.n = n

    def dimension(self) -> int:
        return 1 + self.n * (self.n - 1) // 2

    def project(self, y: torch.Tensor) -> torch.Tensor:
        trace = torch.diagonal(y, dim1=-2, dim2=-1).mean(-1)
        return trace[..., None, None] * torch.eye(self.n, dtype=y.dtype, device=y.device) + skew(y)

    def factor(self, s: torch.Tensor, t: torch.Tensor, eps: float) -> object:
        # project(S X + X T) for X = a I + W (W skew) is (a tr C / n) I + (C W + W C)/2 with C = S + T.
        c = s.double() + t.double()
        tr_c = torch.diagonal(c, dim1=-2, dim2=-1).sum(-1)
        return tr_c + _regulariser(tr_c / self.n, eps), lyapunov_factor(symmetric_eigh(c), eps)

    def solve(self, factors: object, y: torch.Tensor) -> torch.Tensor:
        tr_c, c_factors = factors
        y64 = y.double()
        a = torch.diagonal(y64, dim1=-2, dim2=-1).mean(-1) * self.n / tr_c
        w = lyapunov_apply(c_factors, skew(y64))
        return a[..., None, None] * torch.eye(self.n, dtype=torch.float64, device=y.device) + w


# ----------------------------------------------------------------------------------------------------------------
# Canonical representatives (dressings)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Degeneracy:
    """A cluster of equal singular values (or eigenvalues) inside one head: a residual rotation ambiguity that the
    canonical form breaks deterministically."""

    head: int
    indices: list[int]
    value: float


def sign_fix_columns(u: torch.Tensor) -> torch.Tensor:
    """Signs (..., k) that make the largest-magnitude entry of every column of u (..., n, k) positive."""
    idx = u.abs().argmax(-2, keepdim=True)
    sign = torch.sign(torch.gather(u, -2, idx)).squeeze(-2)
    return torch.where(sign == 0, torch.ones_like(sign), sign)


def degenerate_clusters(values: torch.Tensor, rtol: float) -> list[tuple[int, list[int]]]:
    """Clusters of consecutive entries of each row of a descending-sorted batch (B, k) whose gaps are below
    rtol * max; zero values (below rtol * max) are excluded. Returns (row, indices) for clusters of size >= 2."""
    out = []
    for row, vals in enumerate(values.double().cpu()):
        top = float(vals.max()) if vals.numel() else 0.0
        if top <= 0.0:
            continue
        live = [i for i in range(vals.numel()) if vals[i] > rtol * top]
        cluster = live[:1]
        for i in live[1:]:
            if abs(float(vals[i - 1] - vals[i])) <= rtol * top and i - 1 == cluster[-1]:
                cluster.append(i)
            else:
                if len(cluster) > 1:
                    out.append((row, cluster))
                cluster = [i]
        if len(cluster) > 1:
            out.append((row, cluster))
    return out


def break_degeneracy(u: torch.Tensor, cols: list[int]) -> torch.Tensor:
    """An orthogonal O (m x m) such that u[:, cols] O is a deterministic basis of span(u[:, cols]): the span's
    projector columns at max-volume pivot rows, orthonormalised (QR with positive diagonal). Invariant under any
    rotation of u[:, cols] inside its span."""
    block = u[:, cols]
    pivots = max_volume_rows(block, len(cols))
    basis = block @ block[pivots].T  # projector columns P[:, pivots]
    q, r = torch.linalg.qr(basis)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones_like(torch.diagonal(r)))
    return block.T @ q


def balanced_factors(
    a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[Degeneracy]]:
    """Balanced SVD gauge of DESIGN 2.2 for G = A B^T (batch of A (B, m, r), B (B, n, r)): returns (A', B', s, degs)
    with A' = U S^1/2, B' = V S^1/2, G = U S V^T, so A' B'^T = G and A'^T A' = B'^T B' = S. Signs: the
    largest-magnitude entry of each column of U is positive; clusters of equal nonzero singular values are reported
    and their rotation fixed by `break_degeneracy`. Computed in float64 through QR of A and B (r x r SVD)."""
    a64, b64 = a.double(), b.double()
    r = a64.shape[-1]
    qa, ra = torch.linalg.qr(a64)  # (B, m, k_a), (B, k_a, r)
    qb, rb = torch.linalg.qr(b64)
    core = ra @ rb.transpose(-1, -2)  # (B, k_a, k_b)
    uu, s, wh = torch.linalg.svd(core, full_matrices=False)
    u, v = qa @ uu, qb @ wh.transpose(-1, -2)  # (B, m, k), (B, n, k)
    degs = []
    for head, cols in degenerate_clusters(s, rtol):
        rot = break_degeneracy(u[head], cols)
        u[head][:, cols] = u[head][:, cols] @ rot
        v[head][:, cols] = v[head][:, cols] @ rot
        degs.append(Degeneracy(head, cols, float(s[head, cols[0]])))
    sign = sign_fix_columns(u)
    u, v = u * sign[..., None, :], v * sign[..., None, :]
    root = s.sqrt()[..., None, :]
    a_new, b_new = u * root, v * root
    k = s.shape[-1]
    if k < r:  # fewer rows than columns: pad the factors with zero columns
        a_new = torch.nn.functional.pad(a_new, (0, r - k))
        b_new = torch.nn.functional.pad(b_new, (0, r - k))
        s = torch.nn.functional.pad(s, (0, r - k))
    return a_new, b_new, s, degs


def principal_rotation(
    gram: torch.Tensor, rows: torch.Tensor, rtol: float = 1e-6
) -> tuple[torch.Tensor, list[Degeneracy]]:
    """Principal gauge of DESIGN 2.2: the orthogonal R (n x n) whose columns are the eigenvectors of `gram`
    (descending eigenvalues), each signed so that the largest-magnitude entry of the matching column of rows @ R is
    positive. Returns (R, degeneracies of the spectrum). For rows too big to hold, `principal_axes`, `ColumnSigns`
    fed block by block, then `signed_principal_axes` give the same R."""
    evals, evecs = principal_axes(gram)
    return signed_principal_axes(evals, evecs, sign_fix_columns(rows.double() @ evecs), rtol)


def principal_axes(gram: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors of a symmetric `gram`, unsigned: the first step of
    `principal_rotation`."""
    evals, evecs = symmetric_eigh(gram)
    return evals.flip(-1), evecs.flip(-1)


def signed_principal_axes(
    evals: torch.Tensor, evecs: torch.Tensor, signs: torch.Tensor, rtol: float = 1e-6
) -> tuple[torch.Tensor, list[Degeneracy]]:
    """The last step of `principal_rotation`: columns signed, degenerate clusters broken deterministically."""
    evecs = evecs * signs[None, :]
    degs = []
    for _, cols in degenerate_clusters(evals[None], rtol):
        rot = break_degeneracy(evecs, cols)
        evecs[:, cols] = evecs[:, cols] @ rot
        degs.append(Degeneracy(0, cols, float(evals[cols[0]])))
    return evecs, degs


class ColumnSigns:
    """`sign_fix_columns(M)` for a matrix M seen in row blocks, in order (`update` with each block): the sign of
    the first largest-magnitude entry of each column, as argmax keeps the first index."""

    def __init__(self) -> None:
        self.best: torch.Tensor | None = None
        self.lead: torch.Tensor | None = None

    def update(self, block: torch.Tensor) -> None:
        if block.shape[0] == 0:
            return
        value = torch.gather(block, 0, block.abs().argmax(0, keepdim=True)).squeeze(0)
        if self.best is None:
            self.best, self.lead = value.abs(), value
        else:  # strictly larger: an earlier block keeps a tie
            better = value.abs() > self.best
            self.lead = torch.where(better, value, self.lead)
            self.best = torch.where(better, value.abs(), self.best)

    def signs(self, k: int) -> torch.Tensor:
        if self.lead is None:
            return torch.ones(k, dtype=torch.float64)
        sign = torch.sign(self.lead)
        return torch.where(sign == 0, torch.ones_like(sign), sign)


def balance_complex_pairs(qc: torch.Tensor, kc: torch.Tensor, rotations_only: bool = False) -> torch.Tensor:
    """Canonical complex scalar z per rotary pair for complex columns q (B, m, P) and k (B, n, P), under the action
    q -> z q, k -> k / conj(z): |z|^2 = |k| / |q| (balanced norms; skipped when `rotations_only`), and the phase that
    makes the largest-modulus entry of z q real and positive. Pairs with q = 0 or k = 0 get z = 1. Returns (B, P)."""
    qn, kn = qc.abs().pow(2).sum(-2).sqrt(), kc.abs().pow(2).sum(-2).sqrt()  # (B, P)
    ok = (qn > 0) & (kn > 0)
    modulus = torch.ones_like(qn) if rotations_only else torch.where(ok, (kn / qn.where(ok, 1.0)).sqrt(), 1.0)
    idx = qc.abs().argmax(-2, keepdim=True)
    lead = torch.gather(qc, -2, idx).squeeze(-2)
    phase = torch.where(lead.abs() > 0, lead.conj() / lead.abs().where(lead.abs() > 0, 1.0), torch.ones_like(lead))
    return torch.where(ok, modulus * phase, torch.ones_like(lead))
