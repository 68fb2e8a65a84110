"""Wall time to reach the global VI optimum with one slow client: synchronous vs asynchronous PVI on Ray.

Bayesian logistic regression (N = 8,000, d = 10 + intercept), 8 clients on Ray with 2 workers, each
a Ray actor holding its own rows; one client is 5x slower (its device adds 4x its compute time as a
delay, like a slow phone in a federated round). A synchronous round waits for the slowest client; the
asynchronous server merges every update as it arrives. We report the wall time until the global ELBO
is within 1 % of the global mean-field optimum (a long full-batch SVI run, same ELBO estimator).

    python benchmarks/servers.py            # a few minutes
    python benchmarks/servers.py --quick    # a smoke run
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import ray
from jax import random
from numpyro.infer import SVI, TraceMeanField_ELBO
from numpyro.infer.autoguide import AutoDiagonalNormal

import numpyro_pvi as pvi

NUM_CLIENTS, SLOWDOWN = 8, 5.0


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


class SlowDevice(pvi.GradientUpdate):
    """GradientUpdate on a device where the client holding ``slow_rows`` rows waits ``delay`` s per update."""

    def __init__(self, *args, slow_rows=0, delay=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow_rows, self.delay = slow_rows, delay

    def bind(self, problem):
        update = super().bind(problem)
        slow_rows, delay = self.slow_rows, self.delay

        def wait(size, free_energy):
            if int(size) == slow_rows:
                time.sleep(delay)
            return np.float32(0.0)

        def client_update(rng_key, client, cavity, q, state):
            result = update(rng_key, client, cavity, q, state)
            # depends on the result, so the wait comes after the computation
            zero = jax.pure_callback(wait, jax.ShapeDtypeStruct((), jnp.float32), client.size, result.free_energy)
            return result._replace(free_energy=result.free_energy + zero)

        return client_update


def make_data(num_data, dim, seed=0):
    kx, kw, ky = random.split(random.PRNGKey(seed), 3)
    X = random.normal(kx, (num_data, dim))
    y = random.bernoulli(ky, jax.nn.sigmoid(X @ random.normal(kw, (dim,)) + 0.5)).astype(jnp.float32)
    return X, y


def optimum_elbo(inference, state, X, y, steps):
    guide = AutoDiagonalNormal(model)
    optim = optax.adam(optax.exponential_decay(1e-2, steps, 0.01))
    params = SVI(model, guide, optim, TraceMeanField_ELBO(16)).run(random.PRNGKey(3), steps, X, y=y,
                                                                   progress_bar=False).params
    loc, scale = guide._unpack_latent(params["auto_loc"]), guide._unpack_latent(params["auto_scale"])
    q = inference.family.from_loc_scale(jnp.concatenate([loc["w"], loc["b"][None]]),
                                        jnp.concatenate([scale["w"], scale["b"][None]]))
    return float(inference.evaluate(state._replace(q=q), X, y=y, num_particles=2000))


def client_seconds(parts, X, y, args):
    """Seconds of one client update in process (the fast clients' compute time)."""
    update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=args.steps, num_particles=10)
    inference = pvi.PVI(model, pvi.MeanFieldGaussian(), parts, update, pvi.Synchronous(0.5), backend="loop")
    state = inference.init(random.PRNGKey(0), X, y=y)
    for _ in range(2):
        state, info = inference.update(state, X, y=y)
    return info.time / len(parts)


def time_to_optimum(server, parts, X, y, args, delay, target=None, optimum_steps=0):
    update = SlowDevice(optax.adam(1e-2), num_steps=args.steps, num_particles=10, slow_rows=len(parts[-1]),
                        delay=delay)
    inference = pvi.PVI(model, pvi.MeanFieldGaussian(), parts, update, server, backend=pvi.RayBackend(num_workers=2))
    state = inference.init(random.PRNGKey(0), X, y=y)
    if target is None:
        best = optimum_elbo(inference, state, X, y, optimum_steps)
        target = best - 0.01 * abs(best)
    state, _ = inference.update(state, X, y=y)  # compiles in every actor: not counted
    start, trace = time.perf_counter(), []
    for _ in range(args.max_rounds):
        state, info = inference.update(state, X, y=y)
        elapsed = time.perf_counter() - start
        trace.append((elapsed, info.elbo, info.attempts.tolist()))
        if info.elbo >= target:
            return elapsed, trace, target
    return float("nan"), trace, target


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and rounds: a smoke run")
    parser.add_argument("--steps", type=int, default=200, help="local steps per client update")
    parser.add_argument("--max-rounds", type=int, default=60)
    args = parser.parse_args()
    num_data, optimum_steps = (2000, 4000) if args.quick else (8000, 30000)
    X, y = make_data(num_data, 10)
    # the slow client is told apart by its size: a few rows more than the others
    base = (num_data - 1) // NUM_CLIENTS
    sizes = [base] * (NUM_CLIENTS - 1) + [num_data - (NUM_CLIENTS - 1) * base]
    parts = np.split(np.asarray(random.permutation(random.PRNGKey(1), num_data)), np.cumsum(sizes)[:-1])
    delay = (SLOWDOWN - 1.0) * client_seconds(parts, X, y, args)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    print(f"logistic regression N={num_data}, {NUM_CLIENTS} Ray clients on 2 workers, the last {SLOWDOWN:.0f}x "
          f"slower (+{delay:.3f} s per update); {args.steps} local steps per update\n")
    results = {}
    target = None
    for name, server in [("synchronous", pvi.Synchronous(damping=0.5)), ("asynchronous", pvi.Asynchronous(0.5))]:
        seconds, trace, target = time_to_optimum(server, parts, X, y, args, delay, target, optimum_steps)
        results[name] = seconds
        updates = np.sum([t[2] for t in trace], axis=0)
        print(f"{name:>12}: {seconds:6.1f} s to reach ELBO >= {target:.1f} in {len(trace)} rounds; "
              f"updates per client {updates.tolist()}; last ELBO {trace[-1][1]:.1f}")
    print(f"\nasynchronous / synchronous wall time: {results['asynchronous'] / results['synchronous']:.2f}")
    ray.shutdown()


if __name__ == "__main__":
    main()
