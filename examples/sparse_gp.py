"""Streaming sparse GP regression with PVI (Bui et al. 2018, section 6): inducing outputs are the
global sites.

A 1-D regression problem whose inputs are sorted, so each of the clients holds a contiguous batch of
the input range, as data arriving in time. The model is Titsias' (2009) variational sparse GP in the
whitened parameterisation:

* global site ``v ~ N(0, I_M)``, inducing outputs ``u = f(Z) = L v`` with ``L =
  cholesky(K_zz(theta))``;
* likelihood of row ``n`` inside ``pvi.partition_plate``: ``y_n ~ N(a_n^T v, sigma^2)`` with ``a_n =
  L^{-1} k_zn``, plus the trace correction ``numpyro.factor(-(k_nn - a_n^T a_n) / (2 sigma^2))``;
* kernel hyperparameters (RBF lengthscale, signal variance, noise scale) are ``numpyro.param`` sites
  with ``constraints.positive``, learned by PVI's server from the clients' gradients.

With ``FullRankGaussian`` factors the exact q(v) is in the family, so PVI's fixed point is the
collapsed Titsias bound's optimum: ``q(u)`` is Titsias' optimal ``q(u)`` and the hyperparameters
maximise the collapsed bound. It prints

1. PVI (clients with ``NaturalGradientUpdate(step_size=1)``, sequential rounds, hyperparameters by
   Adam) against the exact GP regression with type-II maximum-likelihood hyperparameters (closed
   form, optimised with optax L-BFGS) and the collapsed Titsias bound's optimum: hyperparameters and
   the predictive mean / sd of f on a grid;
2. the first round, a streaming pass (each batch visited once in time order, its prior the q the
   earlier batches left: online VI), against Titsias' closed-form q(u) at the initial
   hyperparameters.

It exits non-zero if PVI's predictive mean is more than 0.25 exact-GP sd from the exact GP's
anywhere on the grid.

    python examples/sparse_gp.py                       # 20-60 s on 2 CPU cores, most of it
    compilation python examples/sparse_gp.py --plot sparse_gp.png  # and a figure
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random
from jax.scipy.linalg import cho_solve, solve_triangular
from numpyro.distributions import constraints

import numpyro_pvi as pvi

HYPERS = ("lengthscale", "variance", "noise")
JITTER = 1e-5  # added to K_zz, relative to the signal variance (float32)


def rbf(x1, x2, lengthscale, variance):
    return variance * jnp.exp(-0.5 * (x1[:, None] - x2[None, :]) ** 2 / lengthscale**2)


# one compiled call where the model runs eagerly (PVI reads it op by op): much less to compile
@jax.jit
def projection(x, z, lengthscale, variance):
    """``A = K_xz L^{-T}`` (rows ``a_n``) with ``L L^T = K_zz + jitter``: ``f(x) = A v`` and ``Q_xx
    = A A^T``."""
    kzz = rbf(z, z, lengthscale, variance) + JITTER * variance * jnp.eye(z.shape[0])
    chol = jnp.linalg.cholesky(kzz)
    return solve_triangular(chol, rbf(z, x, lengthscale, variance), lower=True).T, chol


def make_model(z, init):
    """The sparse GP with inducing inputs ``z``; ``init`` holds the hyperparameters' initial
    values."""

    def model(x, y=None):
        lengthscale = numpyro.param(
            "lengthscale", init["lengthscale"], constraint=constraints.positive
        )
        variance = numpyro.param("variance", init["variance"], constraint=constraints.positive)
        noise = numpyro.param("noise", init["noise"], constraint=constraints.positive)
        # whitened inducing outputs: the prior has no hyperparameter in it (PVI refuses a param in a
        # global prior)
        v = numpyro.sample("v", dist.Normal(0.0, 1.0).expand([z.shape[0]]).to_event(1))
        a, _ = projection(x, z, lengthscale, variance)
        with pvi.partition_plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(a @ v, noise), obs=y)
            # Titsias' trace term: -(k_nn - q_nn) / (2 sigma^2), the variance of f_n given u that u
            # cannot explain
            numpyro.factor("trace", -0.5 * (variance - jnp.sum(a**2, -1)) / noise**2)

    return model


def make_data(num_data, seed):
    """Sorted inputs on [0, 10] (a stream in time), a smooth function plus N(0, 0.3^2) noise."""
    rng = np.random.default_rng(seed)
    x = np.sort(rng.uniform(0.0, 10.0, num_data))
    f = np.sin(x) + 0.5 * np.sin(2.3 * x + 1.0)
    return jnp.asarray(x, jnp.float32), jnp.asarray(
        f + 0.3 * rng.normal(size=num_data), jnp.float32
    )


# ----------------------------------------------------------------------------- closed forms
# (jax.numpy)


@jax.jit
def exact_log_evidence(log_hyper, x, y):
    """``log N(y; 0, K_xx + sigma^2 I)``: the exact GP's type-II likelihood."""
    ls, var, noise = jnp.exp(log_hyper)
    cov = rbf(x, x, ls, var) + noise**2 * jnp.eye(x.shape[0])
    return dist.MultivariateNormal(jnp.zeros_like(y), cov).log_prob(y)


@jax.jit
def titsias_bound(log_hyper, x, y, z):
    """Titsias' collapsed bound ``log N(y; 0, Q_xx + sigma^2 I) - tr(K_xx - Q_xx) / (2 sigma^2)``.

    By Woodbury with ``m = (sigma^2 I + A^T A)^{-1} A^T y`` (q(v)'s mean), ``y^T (A A^T + sigma^2
    I)^{-1} y =
    |y - A m|^2 / sigma^2 + |m|^2``: a sum of positive terms, without float32 cancellation.
    """
    ls, var, noise = jnp.exp(log_hyper)
    a, _ = projection(x, z, ls, var)
    chol_b = jnp.linalg.cholesky(jnp.eye(z.shape[0]) + a.T @ a / noise**2)
    m = cho_solve((chol_b, True), a.T @ y) / noise**2
    n = x.shape[0]
    logdet = 2 * n * jnp.log(noise) + 2 * jnp.sum(jnp.log(jnp.diagonal(chol_b)))
    quad = jnp.sum((y - a @ m) ** 2) / noise**2 + m @ m
    trace = jnp.sum(var - jnp.sum(a**2, -1)) / noise**2
    return -0.5 * (n * jnp.log(2 * jnp.pi) + logdet + quad + trace)


def maximise(objective, log_hyper, max_steps=50, tol=1e-3):
    """Maximise ``objective(log_hyper)`` with optax L-BFGS until the gradient norm is below
    ``tol``."""
    loss = lambda p: -objective(p)  # noqa: E731
    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss)

    def step(carry):
        params, state = carry
        value, grad = value_and_grad(params, state=state)
        updates, state = opt.update(grad, state, params, value=value, grad=grad, value_fn=loss)
        return optax.apply_updates(params, updates), state

    def running(carry):  # past convergence the line search would only spin on float32 round-off
        count, grad = optax.tree.get(carry[1], "count"), optax.tree.get(carry[1], "grad")
        return (count == 0) | ((count < max_steps) & (optax.tree.norm(grad) >= tol))

    run = jax.jit(lambda p: jax.lax.while_loop(running, step, (p, opt.init(p)))[0])
    return run(log_hyper)


@jax.jit
def exact_predictive(hyper, x, y, xs):
    """The exact GP's predictive mean and sd of ``f(xs)``."""
    ls, var, noise = hyper
    chol = jnp.linalg.cholesky(rbf(x, x, ls, var) + noise**2 * jnp.eye(x.shape[0]))
    kxs = rbf(x, xs, ls, var)
    mean = kxs.T @ cho_solve((chol, True), y)
    w = solve_triangular(chol, kxs, lower=True)
    return mean, jnp.sqrt(jnp.maximum(var - jnp.sum(w**2, 0), 0.0))


@jax.jit
def titsias_q_v(hyper, x, y, z):
    """Titsias' optimal q(v) (whitened: ``u = L v``): mean ``S A^T y / sigma^2``, ``S = (I + A^T A /
    sigma^2)^{-1}``."""
    ls, var, noise = hyper
    a, _ = projection(x, z, ls, var)
    cov = jnp.linalg.inv(jnp.eye(z.shape[0]) + a.T @ a / noise**2)
    return cov @ a.T @ y / noise**2, cov


@jax.jit
def sparse_predictive(hyper, loc, cov, z, xs):
    """Predictive mean and sd of ``f(xs) = A_s v + (f given u)`` under ``q(v) = N(loc, cov)``."""
    ls, var, _ = hyper
    a, _ = projection(xs, z, ls, var)
    sd = jnp.sqrt(jnp.maximum(jnp.sum((a @ cov) * a, -1) + var - jnp.sum(a**2, -1), 0.0))
    return a @ loc, sd


# ----------------------------------------------------------------------------- PVI


def run_pvi(x, y, z, init, num_clients, rounds, lr, num_particles, seed):
    """Sequential PVI rounds with hyperparameter learning; the first round is a streaming pass
    (online VI).

    :return: ``(inference, state, hyperparameters of the final q, RoundInfo per round, q after round
        1)``.
    """
    # x sorted: contiguous batches in time
    parts = np.array_split(np.arange(x.shape[0]), num_clients)
    inference = pvi.PVI(
        make_model(z, init),
        # q(v) is correlated: a mean-field q would not contain the exact posterior
        family=pvi.FullRankGaussian(),
        partitions=parts,
        # The likelihood is Gaussian and linear in v, so one CVI step of size 1 gives a client its
        # exact site for the current hyperparameters, whatever its cavity: every round leaves q at
        # Titsias' optimal q(v) for that round's hyperparameters. The particles only matter for the
        # hyperparameter gradient E_q[d log p(y_m | v) / d theta], whose Monte Carlo noise (sd ~100
        # per draw for the lengthscale) limits Adam: many draws, momentum 0.95, and the
        # hyperparameters still wander ~1-5 % along the flat lengthscale-variance ridge of the bound
        # (< 0.04 nats).
        local_update=pvi.NaturalGradientUpdate(step_size=1.0, num_particles=num_particles),
        # Clients in time order. Factors start flat, so in round 1 each client's cavity is the q its
        # predecessors left: one streaming pass (online VI, like pvi.Continual). Later rounds
        # revisit the batches to learn theta.
        server=pvi.Sequential(),
        hyper_optimizer=optax.adam(optax.exponential_decay(lr, rounds, 0.1), b1=0.95),
    )
    state = inference.init(random.PRNGKey(seed), x, y=y)
    infos = []
    for r in range(rounds):
        # a round's clients use the hyperparameters it starts with, and the server steps them after
        # the round: the final q is Titsias' q(v) for `hyper` (one step behind
        # inference.get_params(state)), so predict with it
        hyper = inference.get_params(state)
        state, info = inference.update(state, x, y=y)
        infos.append(info)
        if r == 0:
            streamed = state.q
    return inference, state, jnp.array([hyper[h] for h in HYPERS]), infos, streamed


@jax.jit
def loc_cov(nat):
    loc, scale_tril = pvi.FullRankGaussian().loc_scale(nat)
    return loc, scale_tril @ scale_tril.T


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-data", type=int, default=300)
    parser.add_argument("--num-inducing", type=int, default=20)
    parser.add_argument("--num-clients", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument(
        "--lr", type=float, default=0.1, help="initial Adam learning rate of the hyperparameters"
    )
    parser.add_argument("--num-particles", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PATH", help="save a figure of the predictive to PATH")
    args = parser.parse_args(argv)

    x, y = make_data(args.num_data, args.seed)
    z = jnp.linspace(0.0, 10.0, args.num_inducing)
    xs = jnp.linspace(-0.5, 10.5, 200)
    # the usual data-driven start: a tenth of the input range, the variance of y, half its sd as
    # noise
    init = {"lengthscale": 1.0, "variance": float(jnp.var(y)), "noise": float(jnp.std(y)) / 2}
    log_init = jnp.log(jnp.array([init[h] for h in HYPERS]))

    exact_log, t_exact = timed(maximise, lambda p: exact_log_evidence(p, x, y), log_init)
    titsias_log, t_titsias = timed(maximise, lambda p: titsias_bound(p, x, y, z), log_init)
    (inference, state, pvi_hyper, infos, streamed), t_pvi = timed(
        run_pvi,
        x,
        y,
        z,
        init,
        args.num_clients,
        args.rounds,
        args.lr,
        args.num_particles,
        args.seed,
    )
    exact_hyper, titsias_hyper = jnp.exp(exact_log), jnp.exp(titsias_log)

    exact_mean, exact_sd = exact_predictive(exact_hyper, x, y, xs)
    loc, cov = loc_cov(state.q)
    pvi_mean, pvi_sd = sparse_predictive(pvi_hyper, loc, cov, z, xs)
    titsias_mean, titsias_sd = sparse_predictive(
        titsias_hyper, *titsias_q_v(titsias_hyper, x, y, z), z, xs
    )

    # the streaming pass (round 1, hyperparameters still at init) against Titsias' q(u) = N(L m, L S
    # L^T) at init
    init_hyper = jnp.exp(log_init)
    _, chol = projection(z, z, init_hyper[0], init_hyper[1])
    (s_loc, s_cov), (t_loc, t_cov) = loc_cov(streamed), titsias_q_v(init_hyper, x, y, z)
    u_sd = jnp.sqrt(jnp.diagonal(chol @ t_cov @ chol.T))
    stream_loc_err = float(jnp.max(jnp.abs(chol @ (s_loc - t_loc)) / u_sd))
    stream_cov_err = float(
        jnp.max(jnp.abs(chol @ (s_cov - t_cov) @ chol.T) / jnp.outer(u_sd, u_sd))
    )

    # the streamed q, before learning theta
    init_mean, _ = sparse_predictive(init_hyper, s_loc, s_cov, z, xs)
    out = {
        "hyper": {
            "init": np.asarray(init_hyper),
            "exact": np.asarray(exact_hyper),
            "titsias": np.asarray(titsias_hyper),
            "pvi": np.asarray(pvi_hyper),
        },
        "mean_err_vs_exact": float(jnp.max(jnp.abs(pvi_mean - exact_mean) / exact_sd)),
        "sd_err_vs_exact": float(jnp.max(jnp.abs(pvi_sd / exact_sd - 1))),
        "mean_err_vs_titsias": float(jnp.max(jnp.abs(pvi_mean - titsias_mean) / titsias_sd)),
        "titsias_mean_err_vs_exact": float(jnp.max(jnp.abs(titsias_mean - exact_mean) / exact_sd)),
        "init_mean_err_vs_exact": float(jnp.max(jnp.abs(init_mean - exact_mean) / exact_sd)),
        "stream_loc_err": stream_loc_err,
        "stream_cov_err": stream_cov_err,
        "evidence": {
            "exact": float(exact_log_evidence(exact_log, x, y)),
            "titsias": float(titsias_bound(titsias_log, x, y, z)),
            "pvi_titsias_bound": float(titsias_bound(jnp.log(pvi_hyper), x, y, z)),
            "pvi_elbo": float(infos[-1].elbo),
        },
        "rejected": int(sum(info.num_rejected for info in infos)),
        "time": {"exact": t_exact, "titsias": t_titsias, "pvi": t_pvi},
        # for tests: the run, the data, the streamed q(v) and the predictive on the grid
        "inference": inference,
        "state": state,
        "data": {
            "x": x,
            "y": y,
            "z": z,
            "xs": xs,
            "streamed": (s_loc, s_cov),
            "pvi": (pvi_mean, pvi_sd),
            "exact": (exact_mean, exact_sd),
        },
    }

    print(
        f"\nSparse GP regression: N={args.num_data} sorted points in {args.num_clients} "
        f"contiguous client batches, M={args.num_inducing} inducing points, {args.rounds} "
        f"sequential PVI rounds ({args.num_particles} draws per client)\n"
    )
    print(
        f"{'':24}{'lengthscale':>12}{'variance':>10}{'noise':>8}"
        f"{'log p(y) / bound':>18}{'time (s)':>10}"
    )
    rows = [
        ("initial", init_hyper, float(titsias_bound(log_init, x, y, z)), None),
        ("exact GP, type-II ML", exact_hyper, out["evidence"]["exact"], t_exact),
        ("Titsias bound optimum", titsias_hyper, out["evidence"]["titsias"], t_titsias),
        ("PVI (learned)", pvi_hyper, out["evidence"]["pvi_titsias_bound"], t_pvi),
    ]
    for name, h, ev, t in rows:
        print(
            f"{name:24}{h[0]:12.4f}{h[1]:10.4f}{h[2]:8.4f}{ev:18.3f}" + (f"{t:10.1f}" if t else "")
        )
    print(
        "(the last column: the exact log evidence for the exact GP, else Titsias' bound at those "
        "hyperparameters)"
    )
    print(
        f"\nPVI's last ELBO estimate {out['evidence']['pvi_elbo']:.3f} (MC, "
        f"{inference.num_elbo_particles} draws); rejected updates: {out['rejected']}"
    )
    print(
        f"Predictive f on {xs.shape[0]} grid points in [-0.5, 10.5], PVI vs exact GP: max |mean "
        f"diff| = {out['mean_err_vs_exact']:.4f} exact sd, max |sd ratio - 1| = "
        f"{out['sd_err_vs_exact']:.4f}"
    )
    print(
        "  (Titsias' sparse GP at its optimum vs exact GP: "
        f"{out['titsias_mean_err_vs_exact']:.4f} sd; PVI vs Titsias: "
        f"{out['mean_err_vs_titsias']:.4f} sd; at the initial hyperparameters: "
        f"{out['init_mean_err_vs_exact']:.4f} sd)"
    )
    print(
        "Round 1 = one streaming pass over the batches at the initial hyperparameters, vs "
        f"Titsias' closed-form q(u): max |mean diff| = {stream_loc_err:.1e} sd, max |cov diff| = "
        f"{stream_cov_err:.1e} sd_i sd_j"
    )

    if args.plot:
        plot(
            args.plot,
            x,
            y,
            xs,
            z,
            (exact_mean, exact_sd),
            (pvi_mean, pvi_sd),
            loc,
            pvi_hyper,
            args.num_clients,
        )
        print(f"Figure saved to {args.plot}")
    if out["mean_err_vs_exact"] > 0.25:
        raise SystemExit(
            f"PVI and the exact GP disagree: {out['mean_err_vs_exact']:.3f} exact sd > 0.25"
        )
    return out


def plot(path, x, y, xs, z, exact, sparse, loc, hyper, num_clients):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    batches = np.array_split(np.arange(x.shape[0]), num_clients)
    for m, idx in enumerate(batches):
        ax.scatter(
            x[idx], y[idx], s=6, alpha=0.7, color=plt.cm.viridis(m / max(num_clients - 1, 1))
        )
    for (mean, sd), label, color, style in [
        (exact, "exact GP (type-II ML), mean and 2 sd", "k", "-"),
        (sparse, "PVI sparse GP, mean and 2 sd", "crimson", "--"),
    ]:
        ax.plot(xs, mean, style, color=color, lw=1.5, label=label)
        ax.fill_between(xs, mean - 2 * sd, mean + 2 * sd, color=color, alpha=0.12)
    _, chol = projection(z, z, hyper[0], hyper[1])
    ax.plot(z, chol @ loc, "o", color="crimson", ms=5, label="q(u) mean at the inducing inputs")
    ax.set(
        xlabel="x (colour: the client batch, in time order)",
        ylabel="f(x)",
        title=f"Sparse GP by PVI over {num_clients} streamed batches vs the exact GP",
    )
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
