"""Many L2-regularised squared-hinge linear SVMs at once (LinearSVC's primal problem), to the optimum.

Problem p (in the VOC07 protocol: one class, one cost, one CV fold) lives on the shared matrix
X̃ = [X, 1] (n × (d+1)): the bias is an extra feature of value 1 that is penalised like the
weights (liblinear's bias handling with ``intercept_scaling`` 1). Its objective is

    f_p(w) = ½‖w‖² + Σ_i s_ip · max(0, 1 − y_ip · w·x̃_i)²,     s_ip = C_p · c_i · [i ∈ rows of p]

with c_i the class weight of example i (2 for positives, 1 for negatives in the protocol), so that
rows outside a problem's training fold simply weigh 0. f_p is differentiable and 1-strongly convex:

    ∇f_p(w) = w − 2 X̃ᵀ (s ∘ y ∘ m),    m_i = max(0, 1 − y_i w·x̃_i)
    H_p     = I + 2 X̃ᵀ diag(s ∘ [m > 0]) X̃      (generalised Hessian)

Method (the finite Newton method of Keerthi & DeCoste 2005, the primal Newton that liblinear's
``-s 2`` also uses): each step solves H_p d = −∇f_p — exactly through the Gram matrix (Woodbury,
one Cholesky of the active rows' block) when at most ``direct_max`` rows are active, else by
conjugate gradients preconditioned with H_p's leading ``block`` × ``block`` block (in ``Basis``
coordinates: the dominant directions of X̃ᵀX̃) and its diagonal elsewhere — then minimises the
piecewise-quadratic f_p(w + t d) over t exactly (a safeguarded 1-D Newton). All problems
advance together, so every Hessian-vector product is one matrix product
X̃ @ V and one X̃ᵀ @ R over the problems still running, and problems leave the batch as they
converge. Callers warm-start each cost from the previous one's solution.

Stopping rule, per problem: ‖∇f_p(w)‖² ≤ 2 ε f_p(w). Because f_p is 1-strongly convex,
f_p(w) − min f_p ≤ ‖∇f_p(w)‖² / 2, so a returned w is certified within a relative ε of the optimum
(``tol`` = ε, default 1e-8) — whatever any other solver returns, our objective exceeds it by at most
ε relative. Works on CPU or CUDA (the device of ``x``), in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_TOL = 1e-8
MAX_NEWTON = 100
MAX_CG = 500


@dataclass
class Solution:
    w: torch.Tensor  # (d+1, P): weights, bias last
    objective: torch.Tensor  # (P,)
    grad_norm: torch.Tensor  # (P,)
    newton_steps: torch.Tensor  # (P,)
    cg_steps: int  # batched Hessian-vector products, all problems together
    converged: torch.Tensor  # (P,) bool


def with_bias(x: torch.Tensor) -> torch.Tensor:
    """X̃ = [X, 1]: the bias as a penalised feature of value 1 (liblinear, intercept_scaling 1)."""
    return torch.cat([x, x.new_ones(x.shape[0], 1)], dim=1)


@dataclass
class Basis:
    """An orthonormal basis V of X̃'s row space, with X̂ = X̃ V: f_p(V v) is the same problem in v
    (‖V v‖ = ‖v‖, and components of w outside the row space are 0 at the optimum), but diag(Ĥ) is
    a far better CG preconditioner there — the dominant directions of X̃ᵀX̃ (the mean of the
    non-negative features, the bias) become coordinates. When d + 1 > n the basis comes from the
    n × n Gram matrix and the problems shrink to n unknowns."""

    xr: torch.Tensor  # X̂ (n, r)
    v: torch.Tensor  # V (d+1, r)
    gram: torch.Tensor  # K = X̃ X̃ᵀ = X̂ X̂ᵀ (n, n), for the direct Newton steps

    @classmethod
    def of(cls, xb: torch.Tensor) -> Basis:
        n, dim = xb.shape
        gram = xb @ xb.T
        if dim <= n:
            _, v = torch.linalg.eigh(xb.T @ xb)
            v = v.flip(1)  # largest eigenvalues first: ``solve``'s dense preconditioner block
        else:  # X̃ = U Σ Vᵀ with K = U Σ² Uᵀ: V = X̃ᵀ U Σ⁻¹, dropping directions with no data
            lam, u = torch.linalg.eigh(gram)
            lam, u = lam.flip(0), u.flip(1)
            keep = lam > lam.max() * 1e-12
            v = (xb.T @ u[:, keep]) / lam[keep].sqrt()
        return cls(xb @ v, v, gram)

    def weights(self, coords: torch.Tensor) -> torch.Tensor:
        """w = V v: the solution in the original (d+1) coordinates."""
        return self.v @ coords

    def coords(self, w: torch.Tensor) -> torch.Tensor:
        return self.v.T @ w


def objective(xb: torch.Tensor, y: torch.Tensor, s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """f_p(w_p) for every column p; xb = X̃ (n, d+1), y and s (n, P), w (d+1, P)."""
    m = (1 - y * (xb @ w)).clamp_min(0)
    return 0.5 * (w * w).sum(0) + (s * m * m).sum(0)


def solve(
    xb: torch.Tensor,
    y: torch.Tensor,
    s: torch.Tensor,
    w0: torch.Tensor | None = None,
    tol: float = DEFAULT_TOL,
    max_newton: int = MAX_NEWTON,
    max_cg: int = MAX_CG,
    gram: torch.Tensor | None = None,
    direct_max: int = 1200,
    block: int = 64,
) -> Solution:
    """Minimise f_p for every column p of y (labels ±1) and s (C_p · c_i, 0 outside the problem's
    rows), from w0 (zeros by default). xb is X̃ = ``with_bias(X)``, float64."""
    n, dim = xb.shape
    problems = y.shape[1]
    w = xb.new_zeros(dim, problems) if w0 is None else w0.clone()
    xsq = xb * xb  # for diag(H)
    kb = min(block, dim)
    pairs = (xb[:, :kb, None] * xb[:, None, :kb]).reshape(n, kb * kb)  # for H's leading kb × kb block
    newton_steps = torch.zeros(problems, dtype=torch.long, device=xb.device)
    converged = torch.zeros(problems, dtype=torch.bool, device=xb.device)
    cg_total = 0
    live = torch.arange(problems, device=xb.device)
    for _ in range(max_newton + 1):
        wl, yl, sl = w[:, live], y[:, live], s[:, live]
        z = xb @ wl
        m = (1 - yl * z).clamp_min(0)
        f = 0.5 * (wl * wl).sum(0) + (sl * m * m).sum(0)
        g = wl - 2 * (xb.T @ (sl * yl * m))
        gsq = (g * g).sum(0)
        done = gsq <= 2 * tol * f
        converged[live[done]] = True
        if done.all() or newton_steps[live].min() >= max_newton:
            break
        keep = ~done
        live, wl, yl, sl, z, m, f, g, gsq = (t[..., keep] for t in (live, wl, yl, sl, z, m, f, g, gsq))
        curv = 2 * sl * (m > 0)  # the diagonal of the generalised Hessian's data term
        precond = 1 + xsq.T @ curv
        # Inexact Newton: a loose direction far from the optimum, tighter as ‖∇f‖ shrinks.
        forcing = torch.clamp(torch.sqrt(gsq.sqrt() / (1 + f)), max=0.1)
        d = torch.empty_like(g)
        xd = torch.empty_like(z)
        small = (curv > 0).sum(0) <= direct_max if gram is not None else torch.zeros_like(done[keep])
        if small.any():
            d[:, small], xd[:, small] = _direct(xb, gram, curv[:, small], g[:, small])
        if not small.all():
            big = ~small
            lead = (pairs.T @ curv[:, big]).T.reshape(-1, kb, kb) + torch.eye(kb, dtype=xb.dtype, device=xb.device)
            factor = torch.linalg.cholesky(lead)
            d[:, big], xd[:, big], steps = _cg(
                xb, curv[:, big], precond[:, big], factor, g[:, big], forcing[big], max_cg
            )
            cg_total += steps
        t = _line_search(wl, d, z, xd, yl, sl)
        w[:, live] = wl + t * d
        newton_steps[live] += 1
    return Solution(
        w,
        objective(xb, y, s, w),
        _grad_norm(xb, y, s, w),
        newton_steps,
        cg_total,
        converged,
    )


def _direct(xb, gram, curv, g):
    """Exact Newton directions d = −H⁻¹ g for problems with few active rows A, by Woodbury:
    H = I + X̃_Aᵀ D X̃_A (D = curv on A) gives H⁻¹ g = g − X̃_Aᵀ (D⁻¹ + K_AA)⁻¹ X̃_A g with
    K = X̃ X̃ᵀ: one |A| × |A| Cholesky per problem instead of CG."""
    xg = xb @ g
    beta = torch.zeros_like(xg)
    for p in range(g.shape[1]):
        rows = torch.nonzero(curv[:, p] > 0).squeeze(1)
        system = gram[rows.unsqueeze(1), rows]
        system.diagonal().add_(1 / curv[rows, p])
        factor = torch.linalg.cholesky(system)
        beta[rows, p] = torch.cholesky_solve(xg[rows, p : p + 1], factor).squeeze(1)
    d = xb.T @ beta - g
    return d, xb @ d


def _grad_norm(xb, y, s, w) -> torch.Tensor:
    m = (1 - y * (xb @ w)).clamp_min(0)
    return (w - 2 * (xb.T @ (s * y * m))).norm(dim=0)


def _precondition(r, precond, factor):
    """M⁻¹ r for M = H's leading kb × kb block (exact, by its Cholesky factor) ⊕ diag(H) elsewhere."""
    z = r / precond
    kb = factor.shape[-1]
    z[:kb] = torch.cholesky_solve(r[:kb].T.unsqueeze(-1), factor).squeeze(-1).T
    return z


def _cg(xb, curv, precond, factor, g, forcing, max_cg):
    """Preconditioned CG on H d = −g per column; returns d, X̃ d and the number of batched steps.
    A column stops when ‖r‖ ≤ forcing · ‖g‖; columns that stop leave the batch. In the Basis
    coordinates the leading block holds the dominant directions of X̃ᵀX̃ (a shared low-rank part of
    the features), which a diagonal preconditioner cannot see."""
    d = torch.zeros_like(g)
    xd = xb.new_zeros(xb.shape[0], g.shape[1])
    r = -g
    zr = _precondition(r, precond, factor)
    p = zr.clone()
    rz = (r * zr).sum(0)
    target = forcing * g.norm(dim=0)
    idx = torch.arange(g.shape[1], device=g.device)
    steps = 0
    for steps in range(1, max_cg + 1):  # noqa: B007  (steps is the count returned)
        xp = xb @ p
        hp = p + xb.T @ (curv[:, idx] * xp)
        alpha = rz / (p * hp).sum(0)
        d[:, idx] += alpha * p
        xd[:, idx] += alpha * xp
        r = r - alpha * hp
        open_ = r.norm(dim=0) > target
        if not open_.any():
            break
        idx, r, p, rz, target, alpha = (t[..., open_] for t in (idx, r, p, rz, target, alpha))
        zr = _precondition(r, precond[:, idx], factor[idx])
        rz_new = (r * zr).sum(0)
        p = zr + (rz_new / rz) * p
        rz = rz_new
    return d, xd, steps


def _line_search(w, d, z, xd, y, s, iterations: int = 50):
    """argmin_t f(w + t d) per column: f is convex and piecewise quadratic in t, so a 1-D Newton
    step is exact once the active set stops changing; a bracket [lo, hi] keeps it safe."""
    wd, dd = (w * d).sum(0), (d * d).sum(0)
    yu = y * xd
    lo = torch.zeros_like(wd)
    hi = torch.full_like(wd, float("inf"))
    t = torch.ones_like(wd)
    for _ in range(iterations):
        m = (1 - y * z - t * yu).clamp_min(0)
        slope = wd + t * dd - 2 * (s * yu * m).sum(0)
        curve = dd + 2 * (s * yu * yu * (m > 0)).sum(0)
        lo = torch.where(slope < 0, t, lo)
        hi = torch.where(slope >= 0, t, hi)
        step = t - slope / curve
        inside = (step > lo) & (step < hi)
        fallback = torch.where(torch.isinf(hi), 2 * t, (lo + hi) / 2)
        new = torch.where(inside, step, fallback)
        if torch.all((new - t).abs() <= 1e-12 * t.abs()):
            t = new
            break
        t = new
    return t
