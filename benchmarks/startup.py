"""Start-up cost: a fresh process, from ``PVI(...)`` to the end of round 1 and of round 20, and the
XLA compilations on the way.

Each configuration runs in its own fresh Python process (so JAX compiles everything from scratch, as
a user's script does), timed from ``PVI(...)`` (imports and data excluded, ``init`` included), in
wall-clock seconds and in the process's CPU seconds (all threads; on a loaded machine the CPU
seconds compare, the wall-clock ones do not):

* ``logistic-M`` (M = 10, 100, 1000): the configuration of ``benchmarks/rounds.py`` (N = 10,000,
  d = 10 + intercept, mean-field, 10 local epochs of batches of 100, 10 particles, Adam 1e-2) with
  ``Synchronous(1.0)``. The PyTorch reference library takes about 2.1 s a round at M = 100, so
  about 42 s for 20 rounds.
* ``dirichlet-1000``: the same data split over 1,000 clients by ``split_by_label`` (alpha 0.3), so
  the clients' sizes are skewed (several size buckets); compare with ``logistic-1000``.
* ``fullrank-50``: logistic regression with d = 50, ``FullRankGaussian``, 10 clients.
* ``snep-poisson``: ``SNEPUpdate`` on the Poisson-Gamma model of
``tests/local_updates/test_snep_blocks.py``
  (five uneven clients, ``Sequential``).
* ``cvi-poisson``: ``NaturalGradientUpdate`` (CVI, 16 particles) with a ``Gamma`` factor on the same
  model and clients, ``Synchronous(1.0)``.
* ``ep-linear``: ``MomentMatchingUpdate`` (EP, Laplace proposal) on the conjugate linear model of
  ``tests/local_updates/test_moment_matching.py`` (``FullRankGaussian``, 4 clients,
  ``Synchronous(1.0)``).
* ``bnn``: a 64-32-32-10 Bayesian neural network on scikit-learn's ``load_digits`` with 10
  label-skewed clients, ``Sequential``, 100 steps of batches of 64 per visit.
* ``ray-10``: ``logistic``'s configuration with 10 clients of 1,000 rows on
  ``RayBackend(num_workers=2, cpus_per_client=0.2)`` (Ray started by the run, so its start is in
  ``init``): every actor compiles its client's update (the same program); in the ``cache`` mode
  they load it from the persistent cache.
* ``svi-compiled`` and ``svi-progress``: NumPyro ``SVI`` on ``logistic-100``'s data doing its
  rounds' steps (20 rounds: 20,000 steps of batches of 100 rows, ``numpyro.plate(...,
  subsample_size=100)``, 10 particles, ``AutoDiagonalNormal``, Adam 1e-2), ``svi.run`` as one
  compiled loop (``progress_bar=False``) or with NumPyro's default progress bar; the table is
  followed by each one's time as a multiple of ``logistic-100``'s run (the issue's target: 6x).
* ``svi-clients``: NumPyro's own local loops of ``logistic-100``'s round 1, without PVI: 100 clients
  of 100 rows, ``jax.vmap`` of ``SVI.init`` and a 10-step ``lax.scan`` of ``SVI.update``
  (``AutoNormal``, ``TraceMeanField_ELBO(10)``, Adam 1e-2, every step on all of a client's rows),
  one compiled call, with PVI's Threefry lowering in place (as in a PVI process); its time, from
  ``SVI(...)`` to the result, is in the ``round 1`` column, and the table is followed by
  ``logistic-100``'s ``init`` and round 1 against it: what a round 1 costs that runs the same
  local loops through NumPyro, before any ELBO, merge or round bookkeeping.
* ``svi-flat``: ``svi-clients`` with the model's coefficients and intercept in one vector site
  (``flat_logistic_model``), so that ``AutoNormal`` has one site, as PVI's tilted model and guide
  have (one site ``_pvi_zeta`` of all the global parameters): the NumPyro part of PVI's round 1
  (``svi-clients``' two sites compile about twice the code).

The compilations are counted with a ``jax.monitoring`` listener on XLA's backend compile event
(``/jax/core/compile/backend_compile_duration``, one per executable built): how many by the end of
round 1 and of the run, their seconds, and the three slowest (name and seconds).

Start-up modes, each a fresh process: ``cold`` (JAX's defaults), ``cache`` (JAX's persistent
compilation cache filled by an earlier process: a user's second run of a script), ``O0``
(``XLA_FLAGS=--xla_backend_optimization_level=0``) and ``O0-elem`` (level 0 with XLA:CPU's
elemental fusion emitter, ``--xla_cpu_use_fusion_emitters=false``: the test suite's setting).

    python benchmarks/startup.py                  # every configuration, cold
    python benchmarks/startup.py --quick          # logistic-100, dirichlet-1000, snep-poisson
    python benchmarks/startup.py --modes cold cache O0 O0-elem --configs logistic-100
    python benchmarks/startup.py --baseline /path/to/main   # before (that checkout) and after

With ``--baseline DIR`` every configuration also runs with the package imported from the checkout
``DIR`` (e.g. a worktree of ``main``): rows ``before`` (``DIR``) and ``after`` (this checkout), each
in its own fresh process, one after the other.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# XLA_FLAGS of the modes that set them
MODE_FLAGS = {
    "O0": ["--xla_backend_optimization_level=0"],
    "O0-elem": ["--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"],
}
CONFIGS = [
    "logistic-10",
    "logistic-100",
    "logistic-1000",
    "dirichlet-1000",
    "fullrank-50",
    "snep-poisson",
    "cvi-poisson",
    "ep-linear",
    "bnn",
    "ray-10",
    "svi-compiled",
    "svi-progress",
    "svi-clients",
    "svi-flat",
]
QUICK = ["logistic-100", "dirichlet-1000", "snep-poisson"]
TARGETS = {"bnn": ("init", 2.0), "logistic-100": ("rounds", 2.0)}
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def logistic_model(X, y=None):
    """Bayesian logistic regression with an intercept, its rows in a partition plate (outside PVI
    exactly a ``numpyro.plate``: ``svi-clients`` runs it through NumPyro alone). Imports here: the
    parent process, which only starts the children, imports no JAX."""
    import numpyro
    import numpyro.distributions as dist

    import numpyro_pvi as pvi

    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)


def flat_logistic_model(X, y=None):
    """``logistic_model`` with its coefficients and intercept in one site ``z``, as PVI's tilted
    model holds the global parameters (``svi-flat``)."""
    import numpyro
    import numpyro.distributions as dist

    z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([X.shape[1] + 1]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ z[:-1] + z[-1]), obs=y)


def logistic_problem(config):
    import jax
    import optax
    from jax import random

    import numpyro_pvi as pvi
    from numpyro_pvi.backends.ray import RayBackend

    name, size = config.split("-")
    size = int(size)
    dim, num_data = (50, 2_000) if name == "fullrank" else (10, 10_000)
    num_clients = 10 if name == "fullrank" else size
    kx, kw, ky = random.split(random.PRNGKey(0), 3)
    X = random.normal(kx, (num_data, dim))
    y = random.bernoulli(ky, jax.nn.sigmoid(X @ random.normal(kw, (dim,)) + 0.5)).astype("float32")
    jax.block_until_ready((X, y))
    if name == "dirichlet":
        parts = pvi.split_by_label(random.PRNGKey(1), y.astype("int32"), num_clients, alpha=0.3)
    else:
        parts = pvi.split_iid(random.PRNGKey(1), num_data, num_clients)
    steps = 10 * -(-num_data // num_clients // 100)
    family = pvi.FullRankGaussian() if name == "fullrank" else pvi.MeanFieldGaussian()

    def build():
        return pvi.PVI(
            logistic_model,
            family,
            parts,
            pvi.GradientUpdate(optax.adam(1e-2), num_steps=steps, num_particles=10, batch_size=100),
            pvi.Synchronous(1.0),
            backend=RayBackend(num_workers=2, cpus_per_client=0.2) if name == "ray" else "vmap",
        )

    return build, (X,), {"y": y}


def poisson_problem(config):
    import jax.numpy as jnp
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    from jax import random

    import numpyro_pvi as pvi

    def model(y=None):
        rate = numpyro.sample("rate", dist.Gamma(2.0, 0.5))
        with pvi.partition_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Poisson(rate), obs=y)

    sizes = [9, 10, 12, 14, 16]
    parts = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
    y = random.poisson(random.PRNGKey(0), 3.0, (sum(sizes),)).astype(jnp.float32)

    def build():
        if config == "cvi-poisson":
            update = pvi.NaturalGradientUpdate(step_size=1.0, num_particles=16)
            return pvi.PVI(model, pvi.Gamma(), parts, update, pvi.Synchronous(1.0))
        return pvi.PVI(model, pvi.Gamma(), parts, pvi.SNEPUpdate(), pvi.Sequential())

    return build, (), {"y": y}


def ep_problem():
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from jax import random

    import numpyro_pvi as pvi

    def model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)

    X = random.normal(random.PRNGKey(0), (300, 3))
    y = X @ jnp.array([1.0, -0.5, 0.3]) + 0.5 * random.normal(random.PRNGKey(1), (300,))
    parts = pvi.split_iid(random.PRNGKey(4), 300, 4)

    def build():
        return pvi.PVI(
            model, pvi.FullRankGaussian(), parts, pvi.MomentMatchingUpdate(), pvi.Synchronous(1.0)
        )

    return build, (X,), {"y": y}


def bnn_problem():
    import jax
    import numpy as np
    import numpyro
    import numpyro.distributions as dist
    import optax
    from jax import random
    from sklearn.datasets import load_digits

    import numpyro_pvi as pvi

    def model(X, y=None):
        h = X
        for i, (a, b) in enumerate([(64, 32), (32, 32), (32, 10)]):
            W = numpyro.sample(f"W{i}", dist.Normal(0.0, 1.0).expand([a, b]).to_event(2))
            c = numpyro.sample(f"b{i}", dist.Normal(0.0, 1.0).expand([b]).to_event(1))
            h = h @ W + c if i == 2 else jax.nn.relu(h @ W + c)
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Categorical(logits=h), obs=y)

    X, y = load_digits(return_X_y=True)
    X, y = (X / 16.0).astype(np.float32), y.astype(np.int32)
    parts = pvi.split_by_label(random.PRNGKey(0), y, 10, alpha=0.5)

    def build():
        return pvi.PVI(
            model,
            pvi.MeanFieldGaussian(),
            parts,
            pvi.GradientUpdate(optax.adam(1e-2), num_steps=100, num_particles=1, batch_size=64),
            pvi.Sequential(),
        )

    return build, (X,), {"y": y}


def record_compilations():
    """The list that a ``jax.monitoring`` listener fills with ``(name, seconds)``, one per
    executable XLA builds from now on."""
    from jax import monitoring

    compiles = []

    def listener(event, seconds, **kw):
        if event == COMPILE_EVENT:
            compiles.append((kw.get("fun_name", "?"), seconds))

    monitoring.register_event_duration_secs_listener(listener)
    return compiles


def compilation_summary(compiles, first):
    """How many compilations, their seconds, and the three slowest of the ``first`` ones."""
    slowest = sorted(compiles[:first], key=lambda c: -c[1])[:3]
    return dict(
        compiles=len(compiles),
        compile_s=sum(s for _, s in compiles),
        slowest=[f"{name} {seconds:.2f}" for name, seconds in slowest],
    )


def svi_child(config, num_rounds):
    """NumPyro ``SVI`` doing the steps of ``logistic-100``'s ``num_rounds`` rounds (100 clients x
    10 steps a round, batches of 100 rows, 10 particles, Adam 1e-2) on the same data, in a fresh
    process: ``svi.run`` as one compiled loop (``progress_bar=False``) or NumPyro's default (a
    progress bar: a Python loop over the compiled step)."""
    import jax
    import optax
    from jax import random
    from numpyro.infer import SVI, TraceMeanField_ELBO
    from numpyro.infer.autoguide import AutoDiagonalNormal
    from rounds import svi_model as model  # the model with NumPyro's own mini-batching

    _, (X,), data = logistic_problem("logistic-100")
    y = data["y"]
    compiles = record_compilations()
    steps = num_rounds * 100 * 10
    start = time.perf_counter()
    svi = SVI(model, AutoDiagonalNormal(model), optax.adam(1e-2), TraceMeanField_ELBO(10))
    result = svi.run(random.PRNGKey(2), steps, X, y, 100, progress_bar=config == "svi-progress")
    jax.block_until_ready(result.params)
    result = dict(rounds=time.perf_counter() - start, steps=steps)
    print(json.dumps(result | compilation_summary(compiles, len(compiles))))


def svi_clients_child(model):
    """NumPyro's own local loops of ``logistic-100``'s round 1 in a fresh process: 100 clients of
    100 rows, ``jax.vmap`` of ``SVI.init`` and 10 ``SVI.update`` steps (``lax.scan``) of ``model``,
    one compiled call, with PVI's Threefry lowering
    (:func:`numpyro_pvi.compilation.unroll_threefry_on_cpu`). The clients' rows are
    ``logistic-100``'s in order (their values do not change what compiles)."""
    import jax
    import optax
    from jax import random
    from numpyro.infer import SVI, TraceMeanField_ELBO
    from numpyro.infer.autoguide import AutoNormal

    from numpyro_pvi.compilation import unroll_threefry_on_cpu

    _, (X,), data = logistic_problem("logistic-100")
    X, y = X.reshape(100, 100, -1), data["y"].reshape(100, 100)
    unroll_threefry_on_cpu()
    compiles = record_compilations()
    start, cpu_start = time.perf_counter(), time.process_time()
    svi = SVI(model, AutoNormal(model), optax.adam(1e-2), TraceMeanField_ELBO(10))

    def visit(rng_key, X, y):
        state = svi.init(rng_key, X, y=y)
        state, losses = jax.lax.scan(lambda s, _: svi.update(s, X, y=y), state, None, length=10)
        return svi.get_params(state), losses

    params = jax.jit(jax.vmap(visit))(random.split(random.PRNGKey(2), 100), X, y)
    jax.block_until_ready(params)
    result = dict(
        round1=time.perf_counter() - start,
        cpu1=time.process_time() - cpu_start,
        compiles1=len(compiles),
        compile_s1=sum(s for _, s in compiles),
    )
    print(json.dumps(result | compilation_summary(compiles, len(compiles))))


def child(config, num_rounds, cache):
    import jax
    from jax import random

    if config in ("svi-clients", "svi-flat"):
        return svi_clients_child(logistic_model if config == "svi-clients" else flat_logistic_model)
    if config.startswith("svi"):
        return svi_child(config, num_rounds)
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if config.startswith(("logistic", "dirichlet", "fullrank", "ray")):
        build, args, kwargs = logistic_problem(config)
    elif config.endswith("poisson"):
        build, args, kwargs = poisson_problem(config)
    else:
        build, args, kwargs = {"ep-linear": ep_problem}.get(config, bnn_problem)()
    compiles = record_compilations()
    start, cpu_start = time.perf_counter(), time.process_time()
    inference = build()
    state = inference.init(random.PRNGKey(2), *args, **kwargs)
    jax.block_until_ready(state.q)
    result = {"init": time.perf_counter() - start}
    rounds = num_rounds
    times, counts, cpu = [], [], []
    for _ in range(rounds):
        state, info = inference.update(state, *args, **kwargs)
        jax.block_until_ready(state.q)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
        counts.append(len(compiles))
    if times:
        result.update(
            round1=times[0],
            cpu1=cpu[0],
            cpu=cpu[-1],
            rounds=times[-1],
            steady=(times[-1] - times[1]) / max(rounds - 2, 1),
            compiles1=counts[0],
            compile_s1=sum(s for _, s in compiles[: counts[0]]),
        )
    result.update(compilation_summary(compiles, counts[0] if counts else len(compiles)))
    print(json.dumps(result))


def run_child(config, num_rounds, mode, cache, source=None):
    env = dict(os.environ)
    # the package imported from ``source`` (a checkout), else from this one
    root = source or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    if mode in MODE_FLAGS:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *MODE_FLAGS[mode]]).strip()
    command = [sys.executable, __file__, "--child", config, "--rounds", str(num_rounds)]
    if mode == "cache":
        command += ["--cache", cache]
        # fills the cache
        subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{config} ({mode}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None)
    parser.add_argument(
        "--modes", nargs="+", choices=["cold", "cache", *MODE_FLAGS], default=["cold"]
    )
    parser.add_argument(
        "--baseline", default=None, help="a checkout to compare with (rows 'before' and 'after')"
    )
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.rounds, args.cache)
    configs = args.configs or (QUICK if args.quick else CONFIGS)
    print(
        "fresh process per configuration and mode; seconds from PVI(...) (imports and data "
        f"excluded); {args.rounds} rounds; compilations (and their seconds) by the end of round 1 "
        "and of the run\n"
    )
    print(
        f"{'configuration':>14} {'mode':>7} {'code':>6} {'init':>6} {'round 1':>8} "
        f"{f'{args.rounds} rounds':>10} {'CPU 1 / all':>13} {'s/round':>8} "
        f"{'XLA@1':>11} {'XLA all':>11}  three slowest by round 1"
    )
    sources = [("before", args.baseline), ("after", None)] if args.baseline else [("", None)]
    runs = [(c, m, s) for c in configs for m in args.modes for s in sources]
    seconds = {}  # (config, mode, code) -> seconds to the end of the run
    first = {}  # (config, mode, code) -> seconds to the end of round 1 (init included)
    for config, mode, (code, source) in runs:
        with tempfile.TemporaryDirectory() as cache:
            r = run_child(config, args.rounds, mode, cache, source)
        if "rounds" in r:
            seconds[config, mode, code] = r["rounds"]
        first[config, mode, code] = r.get("round1")
        print(row(config, mode, code, r), flush=True)
    print(
        "\nreference: the PyTorch PVI library takes about 42 s for 20 synchronous rounds at M = 100"
    )
    for (config, mode, code), value in seconds.items():
        pvi_s = seconds.get(("logistic-100", mode, code))
        if config.startswith("svi") and pvi_s:
            print(
                f"{config} ({mode}{', ' + code if code else ''}): NumPyro SVI, the same "
                f"{args.rounds * 1000:,} steps, takes {value / pvi_s:.1f}x logistic-100's "
                f"{args.rounds} rounds ({value:.2f} s against {pvi_s:.2f} s)"
            )
    for (config, mode, code), value in first.items():
        pvi_s = first.get(("logistic-100", mode, code))
        if config in ("svi-clients", "svi-flat") and pvi_s:
            sites = "w and b" if config == "svi-clients" else "one site, as PVI's tilted model"
            print(
                f"{config} ({mode}{', ' + code if code else ''}): NumPyro's own local loops of "
                f"logistic-100's round 1 ({sites}) take {value:.2f} s; logistic-100's init and "
                f"round 1 (such loops, the clients' ELBO terms and the merge) {pvi_s:.2f} s, "
                f"{pvi_s / value:.2f}x"
            )


def row(config, mode, code, r):
    """A configuration's line of the table (an SVI run has no rounds: its time is the run's)."""
    cells = [
        f"{r['init']:6.2f}" if "init" in r else "",
        f"{r['round1']:8.2f}" if "round1" in r else "",
        f"{r['rounds']:10.2f}" if "rounds" in r else "",
        f"{r['cpu1']:6.1f} " + (f"{r['cpu']:6.1f}" if "cpu" in r else " " * 6)
        if "cpu1" in r
        else "",
        f"{r['steady']:8.4f}" if "steady" in r else "",
        f"{r['compiles1']:3d} {r['compile_s1']:6.2f}s" if "compiles1" in r else "",
    ]
    cells.append(f"{r['compiles']:3d} {r['compile_s']:6.2f}s")
    target = ""
    if config in TARGETS and mode == "cold":
        key, limit = TARGETS[config]
        target = f"  [{key} < {limit} s: {'met' if r[key] < limit else 'missed'}]"
    return (
        f"{config:>14} {mode:>7} {code:>6} "
        + " ".join(f"{c:>{w}}" for c, w in zip(cells, (6, 8, 10, 13, 8, 11, 11)))
        + "  "
        + ", ".join(r["slowest"])
        + target
    )


if __name__ == "__main__":
    main()
