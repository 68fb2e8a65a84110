"""Recompute the sweep's stored references: ``benchmarks/references/<model>_<prior>.json``.

For every model and prior of ``sweep.py`` (the split does not change the posterior): NUTS (2 chains
x 1000 draws after 1000 warm-up; the conjugate model's exact posterior instead) and the VI optimum
of each family, run long with NumPyro ``SVI`` from the NUTS means: ``AutoNormal`` (mean field),
``AutoMultivariateNormal`` over the global sites (full rank; per-row local latents keep
``AutoNormal``, as PVI's local guides do), and for ``SiteFamilies`` a Gamma guide on the model's
positive site beside ``AutoNormal`` (mean field) on the rest. Each entry is site -> [means, sds] of
the constrained draws, flattened.

    python benchmarks/make_references.py          # all (about 40 min on the shared 2-core machine)
    python benchmarks/make_references.py negbin   # one model, both priors
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random
from numpyro.diagnostics import summary
from numpyro.handlers import block
from numpyro.infer import MCMC, NUTS, SVI, Predictive, Trace_ELBO
from numpyro.infer.autoguide import AutoMultivariateNormal, AutoNormal
from numpyro.infer.initialization import init_to_value

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import MODELS, PRIORS, REFERENCES, conjugate_exact, moments, reference_path  # noqa: E402

NUM_WARMUP, NUM_SAMPLES, NUM_CHAINS = 1000, 1000, 2
SVI_STEPS, SVI_PARTICLES, NUM_DRAWS = 3000, 8, 20000


def nuts_samples(model, args, kwargs) -> tuple[dict, dict]:
    mcmc = MCMC(
        NUTS(model),
        num_warmup=NUM_WARMUP,
        num_samples=NUM_SAMPLES,
        num_chains=NUM_CHAINS,
        chain_method="sequential",
        progress_bar=False,
    )
    mcmc.run(random.PRNGKey(0), *args, **kwargs)
    grouped = mcmc.get_samples(group_by_chain=True)
    stats = summary(grouped)
    diagnostics = {
        "min_ess": float(min(np.min(s["n_eff"]) for s in stats.values())),
        "max_r_hat": float(max(np.max(s["r_hat"]) for s in stats.values())),
    }
    return mcmc.get_samples(), diagnostics


def gamma_guide(site: str, mean: float):
    def guide(*args, **kwargs):
        shape = numpyro.param(f"{site}_shape", 50.0, constraint=dist.constraints.positive)
        rate = numpyro.param(f"{site}_rate", 50.0 / mean, constraint=dist.constraints.positive)
        numpyro.sample(site, dist.Gamma(shape, rate))

    return guide


def guide_parts(kind: str, model, spec, init) -> list:
    """The guide of a family's VI optimum, as autoguides on blocked parts of the model."""
    init_loc_fn = init_to_value(values=init)
    if kind == "meanfield":
        return [AutoNormal(model, init_loc_fn=init_loc_fn, init_scale=0.05)]
    if kind == "fullrank":
        hidden = list(spec.local_sites)
        parts = [
            AutoMultivariateNormal(
                block(model, hide=hidden), init_loc_fn=init_loc_fn, init_scale=0.05
            )
        ]
        # hide the global sites, not expose the locals: the partition plate must stay seen
        if hidden:
            globals_ = [site for site in init if site not in hidden]
            parts.append(
                AutoNormal(block(model, hide=globals_), init_loc_fn=init_loc_fn, init_scale=0.05)
            )
        return parts
    return [
        AutoNormal(block(model, hide=[spec.gamma_site]), init_loc_fn=init_loc_fn, init_scale=0.05),
        gamma_guide(spec.gamma_site, float(np.mean(init[spec.gamma_site]))),
    ]


def vi_optimum(kind: str, model, spec, args, kwargs, init, sites) -> dict:
    parts = guide_parts(kind, model, spec, init)

    def guide(*a, **k):
        for part in parts:
            part(*a, **k)

    optimizer = optax.adam(optax.cosine_decay_schedule(0.01, SVI_STEPS, alpha=0.01))
    svi = SVI(model, guide, optimizer, Trace_ELBO(num_particles=SVI_PARTICLES))
    result = svi.run(random.PRNGKey(1), SVI_STEPS, *args, progress_bar=False, **kwargs)
    draws = Predictive(guide, params=result.params, num_samples=NUM_DRAWS)(
        random.PRNGKey(2), *args, **kwargs
    )
    return moments(draws, sites)


def make(name: str, prior_name: str) -> dict:
    spec, prior = MODELS[name], PRIORS[prior_name]
    model = spec.make(prior)
    args, kwargs = spec.data()
    start = time.perf_counter()
    if name == "conjugate":
        nuts, diagnostics = conjugate_exact(prior, args, kwargs), {"exact": True}
        init = {site: np.asarray(m[0][0]) for site, m in nuts.items()}
    else:
        samples, diagnostics = nuts_samples(model, args, kwargs)
        sites = [s for s in samples if s not in spec.local_sites]
        nuts = moments(samples, sites)
        init = {site: np.asarray(np.mean(v, 0)) for site, v in samples.items()}
    sites = list(nuts)
    kinds = ["meanfield", "fullrank"] + (["sitefamilies"] if spec.gamma_site else [])
    vi = {kind: vi_optimum(kind, model, spec, args, kwargs, init, sites) for kind in kinds}
    if name == "conjugate":
        vi["sitefamilies"] = nuts  # the Gamma block and the Gaussian mean are exact here
    return {
        "model": name,
        "prior": prior_name,
        "nuts": nuts,
        "vi": vi,
        "diagnostics": diagnostics,
        "seconds": round(time.perf_counter() - start, 1),
        "made_by": "benchmarks/make_references.py",
    }


def main(names: list[str]) -> None:
    REFERENCES.mkdir(exist_ok=True)
    for name in names or list(MODELS):
        for prior_name in PRIORS:
            reference = make(name, prior_name)
            with open(reference_path(name, prior_name), "w") as f:
                json.dump(reference, f, indent=1)
            print(
                f"{name} {prior_name}: {reference['diagnostics']} {reference['seconds']} s",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
