"""The validation sweep: every cell of a pairwise design is RIGHT, FLAGGED or refused by name, never
wrong and silent.

Factors (issue 23): model {logistic with correlated features, Poisson and negative-binomial
log-link, StudentT, a hierarchical model with per-row local latents, a conjugate Normal +
Poisson-Gamma model} x split {iid, skewed: rows sorted by the response and cut into uneven clients}
x prior {default, wide} x local update {GradientUpdate, NaturalGradientUpdate (CVI),
MomentMatchingUpdate (EP), SNEPUpdate} x family {MeanFieldGaussian, FullRankGaussian, SiteFamilies
with a Gamma block} x server {Sequential(), Synchronous(), Asynchronous()}. A greedy all-pairs
generator picks cells until every pair of levels that some valid cell holds is covered; invalid
cells (a Gamma block on a model without a positive site; an update that declares no support for
local latents on the hierarchical model) are left out, and the latter are run once each as refusal
probes (the library must refuse them by name).

A cell is RIGHT if every global coordinate's mean is within 0.25 NUTS sd of NUTS and its sd within
25 % of NUTS's, or within 0.2 sd (means and sds) of the VI optimum of its family (``references/``,
made by ``make_references.py``). Otherwise it must be FLAGGED: ``result.converged`` is False and a
``pvi.PVIWarning`` was raised. Anything else is WRONG-SILENT (the bug list).

    python benchmarks/sweep.py                     # the whole design, table to stdout
    python benchmarks/sweep.py --quick             # the first 4 cells
    python benchmarks/sweep.py --cells 10 --out docs/validation.md
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
from jax import random

import numpyro_pvi as pvi

REFERENCES = Path(__file__).resolve().parent / "references"
NUM_CLIENTS = 5
SKEWED_FRACTIONS = (0.4, 0.25, 0.15, 0.12, 0.08)
NUM_ROUNDS = 20
TOL = 0.05
# draws from q for its moments: Monte Carlo error 1/sqrt(4000) = 0.016 sd on a mean
NUM_DRAWS = 4000
NUTS_MEAN_TOL, NUTS_SD_TOL = 0.25, 0.25
VI_TOL = 0.2

# ------------------------------------------------------------------ priors and models

PRIORS = {
    "default": {"w_scale": 1.0, "gamma": (2.0, 1.0)},
    "wide": {"w_scale": 10.0, "gamma": (1.0, 0.1)},
}


class Model(NamedTuple):
    """A sweep model: ``make(prior) -> model``, its seeded data, the site a Gamma block takes (or
    None)."""

    name: str
    make: Callable[[dict], Callable]
    data: Callable[[], tuple[tuple, dict]]
    response: Callable[[tuple, dict], np.ndarray]
    gamma_site: str | None
    local_sites: tuple = ()


def _weights(prior: dict, dim: int) -> tuple:
    w = numpyro.sample("w", dist.Normal(0.0, prior["w_scale"]).expand([dim]).to_event(1))
    b = numpyro.sample("b", dist.Normal(0.0, prior["w_scale"]))
    return w, b


def _correlated_x(key: Any, n: int, d: int, rho: float = 0.8) -> np.ndarray:
    cov = rho * np.ones((d, d)) + (1 - rho) * np.eye(d)
    return np.asarray(random.multivariate_normal(key, jnp.zeros(d), jnp.asarray(cov), (n,)))


def make_logistic(prior: dict) -> Callable:
    def logistic(X, y=None):
        w, b = _weights(prior, X.shape[1])
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=X @ w + b), obs=y)

    return logistic


def logistic_data() -> tuple:
    k1, k2 = random.split(random.PRNGKey(11))
    X = _correlated_x(k1, 600, 4)
    logits = X @ np.array([1.0, -0.5, 0.5, 0.0]) + 0.3
    y = np.asarray(random.bernoulli(k2, 1 / (1 + np.exp(-logits)))).astype(np.float32)
    return (X,), {"y": y}


def make_poisson(prior: dict) -> Callable:
    def poisson(X, y=None):
        w, b = _weights(prior, X.shape[1])
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Poisson(jnp.exp(X @ w + b)), obs=y)

    return poisson


def poisson_data() -> tuple:
    k1, k2 = random.split(random.PRNGKey(12))
    X = 0.5 * _correlated_x(k1, 800, 3, 0.5)
    y = np.asarray(random.poisson(k2, np.exp(X @ np.array([0.5, -0.3, 0.2]) + 1.5))).astype(
        np.float32
    )
    return (X,), {"y": y}


def make_negbin(prior: dict) -> Callable:
    def negbin(X, y=None):
        w, b = _weights(prior, X.shape[1])
        phi = numpyro.sample("phi", dist.Gamma(*prior["gamma"]))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.NegativeBinomial2(jnp.exp(X @ w + b), phi), obs=y)

    return negbin


def negbin_data() -> tuple:
    k1, k2, k3 = random.split(random.PRNGKey(13), 3)
    X = 0.5 * _correlated_x(k1, 800, 2, 0.5)
    mean, phi = np.exp(X @ np.array([0.6, -0.4]) + 1.0), 3.0
    rate = random.gamma(k2, phi, mean.shape) * mean / phi
    y = np.asarray(random.poisson(k3, rate)).astype(np.float32)
    return (X,), {"y": y}


def make_studentt(prior: dict) -> Callable:
    def studentt(X, y=None):
        w, b = _weights(prior, X.shape[1])
        sigma = numpyro.sample("sigma", dist.Gamma(*prior["gamma"]))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.StudentT(4.0, X @ w + b, sigma), obs=y)

    return studentt


def studentt_data() -> tuple:
    k1, k2 = random.split(random.PRNGKey(14))
    X = _correlated_x(k1, 400, 2, 0.5)
    y = np.asarray(X @ np.array([1.0, -1.0]) + 0.5 + 0.7 * random.t(k2, 4.0, (400,))).astype(
        np.float32
    )
    return (X,), {"y": y}


def make_hierarchical(prior: dict) -> Callable:
    def hierarchical(X, y=None):
        w, b = _weights(prior, X.shape[1])
        sigma = numpyro.sample("sigma", dist.Gamma(*prior["gamma"]))
        with pvi.partition_plate("data", X.shape[0]):
            z = numpyro.sample("z", dist.Normal(X @ w + b, sigma))  # a local latent per row
            numpyro.sample("y", dist.Normal(z, 0.5), obs=y)

    return hierarchical


def hierarchical_data() -> tuple:
    k1, k2, k3 = random.split(random.PRNGKey(15), 3)
    X = _correlated_x(k1, 200, 2, 0.5)
    z = X @ np.array([0.8, -0.5]) + 0.2 + 1.0 * np.asarray(random.normal(k2, (200,)))
    y = np.asarray(z + 0.5 * random.normal(k3, (200,))).astype(np.float32)
    return (X,), {"y": y}


def make_conjugate(prior: dict) -> Callable:
    def conjugate(x, counts=None):
        mu = numpyro.sample("mu", dist.Normal(0.0, prior["w_scale"]))
        lam = numpyro.sample("lam", dist.Gamma(*prior["gamma"]))
        with pvi.partition_plate("data", x.shape[0]):
            numpyro.sample("x", dist.Normal(mu, 1.0), obs=x)
            numpyro.sample("counts", dist.Poisson(lam), obs=counts)

    return conjugate


def conjugate_data() -> tuple:
    k1, k2 = random.split(random.PRNGKey(16))
    x = np.asarray(1.5 + random.normal(k1, (200,))).astype(np.float32)
    counts = np.asarray(random.poisson(k2, 3.0, (200,))).astype(np.float32)
    return (x,), {"counts": counts}


MODELS = {
    m.name: m
    for m in [
        Model("logistic", make_logistic, logistic_data, lambda a, k: k["y"], None),
        Model("poisson", make_poisson, poisson_data, lambda a, k: k["y"], None),
        Model("negbin", make_negbin, negbin_data, lambda a, k: k["y"], "phi"),
        Model("studentt", make_studentt, studentt_data, lambda a, k: k["y"], "sigma"),
        Model(
            "hierarchical",
            make_hierarchical,
            hierarchical_data,
            lambda a, k: k["y"],
            "sigma",
            ("z",),
        ),
        Model("conjugate", make_conjugate, conjugate_data, lambda a, k: a[0], "lam"),
    ]
}


def conjugate_exact(prior: dict, args: tuple, kwargs: dict) -> dict:
    """The exact posterior of the conjugate model (independent Normal and Gamma): site -> (mean,
    sd)."""
    x, counts = np.asarray(args[0], np.float64), np.asarray(kwargs["counts"], np.float64)
    precision = 1 / prior["w_scale"] ** 2 + len(x)
    shape, rate = prior["gamma"][0] + counts.sum(), prior["gamma"][1] + len(counts)
    return {
        "mu": ([x.sum() / precision], [precision**-0.5]),
        "lam": ([shape / rate], [np.sqrt(shape) / rate]),
    }


# ------------------------------------------------------------------ the factors and their levels


def split(model: Model, level: str, args: tuple, kwargs: dict) -> list[np.ndarray]:
    """``iid``: 5 equal random clients; ``skewed``: rows sorted by the response, cut 40/25/15/12/8
    %."""
    n = len(model.response(args, kwargs))
    if level == "iid":
        return pvi.split_iid(random.PRNGKey(3), n, NUM_CLIENTS)
    order = np.argsort(np.asarray(model.response(args, kwargs)), kind="stable")
    cuts = np.cumsum(np.round(np.array(SKEWED_FRACTIONS) * n).astype(int))[:-1]
    return [np.sort(part) for part in np.split(order, cuts)]


def local_update(level: str) -> Any:
    if level == "gradient":
        return pvi.GradientUpdate(optax.adam(0.02), num_steps=200, num_particles=8)
    if level == "cvi":
        return pvi.NaturalGradientUpdate(step_size=0.5, num_steps=5, num_particles=32)
    if level == "ep":
        return pvi.MomentMatchingUpdate()
    return pvi.SNEPUpdate(num_steps=50, refresh_every=4, num_chains=4)


def family(level: str, model: Model) -> Any:
    if level == "meanfield":
        return pvi.MeanFieldGaussian()
    if level == "fullrank":
        return pvi.FullRankGaussian()
    return pvi.SiteFamilies({model.gamma_site: pvi.Gamma()})


def server(level: str) -> Any:
    return {
        "sequential": pvi.Sequential,
        "synchronous": pvi.Synchronous,
        "asynchronous": pvi.Asynchronous,
    }[level]()


FACTORS = {
    "model": list(MODELS),
    "split": ["iid", "skewed"],
    "prior": ["default", "wide"],
    "update": ["gradient", "cvi", "ep", "snep"],
    "family": ["meanfield", "fullrank", "sitefamilies"],
    "server": ["sequential", "synchronous", "asynchronous"],
}


def supports_local_latents(update_level: str) -> bool:
    return bool(getattr(type(local_update(update_level)), "supports_local_latents", False))


def valid(cell: dict) -> bool:
    """False for combinations that cannot be asked: a Gamma block needs a positive site; local
    latents need an update that declares support (the unsupported ones are run as refusal probes
    instead)."""
    model = MODELS[cell["model"]]
    if cell["family"] == "sitefamilies" and model.gamma_site is None:
        return False
    return not (model.local_sites and not supports_local_latents(cell["update"]))


def refusal_probes() -> list[dict]:
    """One cell per (model with local latents, update without support): the library must refuse it
    by name."""
    return [
        dict(
            model=m.name,
            split="iid",
            prior="default",
            update=u,
            family="meanfield",
            server="sequential",
        )
        for m in MODELS.values()
        if m.local_sites
        for u in FACTORS["update"]
        if not supports_local_latents(u)
    ]


def all_pairs(factors: dict, is_valid: Callable[[dict], bool]) -> list[dict]:
    """Greedy all-pairs design: add the valid cell covering most uncovered pairs until every pair
    held by some valid cell is covered (ties: the first in product order, so the design is
    deterministic)."""
    names = list(factors)
    cells = [dict(zip(names, levels)) for levels in itertools.product(*factors.values())]
    cells = [c for c in cells if is_valid(c)]

    def pairs(c: dict) -> set:
        return {((a, c[a]), (b, c[b])) for a, b in itertools.combinations(names, 2)}

    cell_pairs = [pairs(c) for c in cells]
    uncovered = set().union(*cell_pairs)
    design = []
    while uncovered:
        best = max(range(len(cells)), key=lambda i: len(cell_pairs[i] & uncovered))
        design.append(cells[best])
        uncovered -= cell_pairs[best]
    return design


# ------------------------------------------------------------------ references and scoring


def reference_path(model: str, prior: str) -> Path:
    return REFERENCES / f"{model}_{prior}.json"


def load_reference(model: str, prior: str) -> dict:
    with open(reference_path(model, prior)) as f:
        return json.load(f)


def moments(samples: dict, sites: list[str]) -> dict:
    """site -> (means, sds) of the flattened draws."""
    out = {}
    for site in sites:
        x = np.asarray(samples[site], np.float64).reshape(len(samples[site]), -1)
        out[site] = (x.mean(0).tolist(), x.std(0).tolist())
    return out


def errors(got: dict, ref: dict) -> tuple[float, float]:
    """Worst |mean - ref mean| / ref sd and worst |sd / ref sd - 1| over every global coordinate."""
    mean_err, sd_err = 0.0, 0.0
    for site, (ref_mean, ref_sd) in ref.items():
        mean, sd = np.asarray(got[site][0]), np.asarray(got[site][1])
        ref_mean, ref_sd = np.asarray(ref_mean), np.asarray(ref_sd)
        mean_err = max(mean_err, float(np.max(np.abs(mean - ref_mean) / ref_sd)))
        sd_err = max(sd_err, float(np.max(np.abs(sd / ref_sd - 1))))
    return mean_err, sd_err


class Outcome(NamedTuple):
    cell: dict
    verdict: str  # RIGHT, FLAGGED, WRONG-SILENT, refused, ERROR
    nuts_mean: float  # worst mean error in NUTS sds
    nuts_sd: float  # worst |sd / NUTS sd - 1|
    vi_mean: float  # the same against the family's VI optimum
    vi_sd: float
    converged: Any
    rounds: int
    warnings: str  # the warnings' first words
    seconds: float


def classify(nuts: tuple, vi: tuple, converged: Any, warned: bool) -> str:
    right = (nuts[0] <= NUTS_MEAN_TOL and nuts[1] <= NUTS_SD_TOL) or (
        vi[0] <= VI_TOL and vi[1] <= VI_TOL
    )
    if right:
        return "RIGHT"
    return "FLAGGED" if converged is False and warned else "WRONG-SILENT"


def first_words(message: str, n: int = 6) -> str:
    return " ".join(str(message).split()[:n])


def run_cell(cell: dict, num_rounds: int = NUM_ROUNDS, tol: float = TOL, seed: int = 0) -> Outcome:
    """Run one cell and score it against the stored references."""
    model = MODELS[cell["model"]]
    prior = PRIORS[cell["prior"]]
    args, kwargs = model.data()
    ref = load_reference(cell["model"], cell["prior"])
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            inference = pvi.PVI(
                model.make(prior),
                family(cell["family"], model),
                partitions=split(model, cell["split"], args, kwargs),
                local_update=local_update(cell["update"]),
                server=server(cell["server"]),
            )
            result = inference.run(
                random.PRNGKey(seed), num_rounds, *args, tol=tol, progress_bar=False, **kwargs
            )
            samples = result.sample_posterior(random.PRNGKey(seed + 1), NUM_DRAWS)
        except (ValueError, TypeError, NotImplementedError) as error:
            return Outcome(
                cell,
                "refused",
                np.nan,
                np.nan,
                np.nan,
                np.nan,
                None,
                0,
                f"{type(error).__name__}: {first_words(error, 12)}",
                time.perf_counter() - start,
            )
        except Exception as error:  # noqa: BLE001 - a crash is a finding, recorded
            return Outcome(
                cell,
                "ERROR",
                np.nan,
                np.nan,
                np.nan,
                np.nan,
                None,
                0,
                f"{type(error).__name__}: {first_words(error, 12)}",
                time.perf_counter() - start,
            )
    seconds = time.perf_counter() - start
    got = moments(samples, list(ref["nuts"]))
    nuts = errors(got, ref["nuts"])
    vi = errors(got, ref["vi"][cell["family"]])
    messages = [first_words(w.message) for w in caught if issubclass(w.category, pvi.PVIWarning)]
    converged = None if result.converged is None else bool(result.converged)
    verdict = classify(nuts, vi, converged, bool(messages))
    return Outcome(
        cell,
        verdict,
        *nuts,
        *vi,
        converged,
        len(result.history.elbo),
        "; ".join(dict.fromkeys(messages)),
        seconds,
    )


def run_cell_isolated(cell: dict, timeout: float) -> Outcome:
    """:func:`run_cell` in a child process stopped after ``timeout`` seconds: a hang becomes the
    verdict ``HANGS`` instead of stopping the sweep (a compiled step that never returns cannot be
    interrupted)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "outcome.json"
        start = time.perf_counter()
        try:
            subprocess.run(
                [sys.executable, __file__, "--one-cell", json.dumps(cell), "--one-out", str(out)],
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return Outcome(
                cell,
                "HANGS",
                np.nan,
                np.nan,
                np.nan,
                np.nan,
                None,
                0,
                f"stopped after {timeout:.0f} s",
                time.perf_counter() - start,
            )
        if not out.exists():
            return Outcome(
                cell,
                "ERROR",
                np.nan,
                np.nan,
                np.nan,
                np.nan,
                None,
                0,
                "the cell's process died",
                time.perf_counter() - start,
            )
        return Outcome(**json.loads(out.read_text()))


# ------------------------------------------------------------------ the table

COLUMNS = [
    "#",
    "model",
    "split",
    "prior",
    "update",
    "family",
    "server",
    "verdict",
    "mean err (NUTS sd)",
    "sd err (NUTS)",
    "mean err (VI sd)",
    "sd err (VI)",
    "converged",
    "rounds",
    "warnings",
    "s",
]


def row(i: int, o: Outcome) -> str:
    def f(x: float) -> str:
        return "" if np.isnan(x) else f"{x:.2f}"

    verdict = f"**{o.verdict}**" if o.verdict in ("WRONG-SILENT", "ERROR", "HANGS") else o.verdict
    cells = [
        str(i),
        *o.cell.values(),
        verdict,
        f(o.nuts_mean),
        f(o.nuts_sd),
        f(o.vi_mean),
        f(o.vi_sd),
        str(o.converged),
        str(o.rounds),
        o.warnings.replace("|", "/"),
        f"{o.seconds:.0f}",
    ]
    if o.verdict == "not run":
        cells[-4:] = ["", "", "", ""]
    return "| " + " | ".join(cells) + " |"


def table(outcomes: list[Outcome], header: str) -> str:
    counts = {
        v: sum(o.verdict == v for o in outcomes)
        for v in ("RIGHT", "FLAGGED", "WRONG-SILENT", "refused", "ERROR", "HANGS", "not run")
    }
    lines = [
        header,
        "",
        "Verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items()),
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += [row(i, o) for i, o in enumerate(outcomes, 1)]
    return "\n".join(lines) + "\n"


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the first 4 cells only")
    parser.add_argument(
        "--cells", type=int, default=None, help="run only the first N cells of the design"
    )
    parser.add_argument(
        "--models", default=None, help="comma-separated: run only these models' cells"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument(
        "--rows",
        type=Path,
        default=None,
        help="append each outcome to this JSON-lines file as it ends; with --table, read them",
    )
    parser.add_argument(
        "--table", action="store_true", help="only render --rows' outcomes as the table"
    )
    parser.add_argument("--no-probes", action="store_true", help="skip the refusal probes")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="run each cell in a child process stopped after this many seconds (verdict HANGS)",
    )
    # the child of --timeout
    parser.add_argument("--one-cell", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--one-out", type=Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.one_cell:
        outcome = run_cell(json.loads(options.one_cell))
        options.one_out.write_text(json.dumps(outcome._asdict(), default=str))
        return
    design = all_pairs(FACTORS, valid)
    limit = 4 if options.quick else options.cells
    cells = design[:limit] if limit else design
    probes = [] if options.no_probes or limit else refusal_probes()
    if options.models:
        keep = options.models.split(",")
        cells, probes = (
            [c for c in cells if c["model"] in keep],
            [c for c in probes if c["model"] in keep],
        )
    if options.table:
        outcomes = [Outcome(**json.loads(line)) for line in options.rows.read_text().splitlines()]
        order = [json.dumps(c) for c in design + refusal_probes()]
        ran = {json.dumps(o.cell) for o in outcomes}
        outcomes += [
            Outcome(c, "not run", np.nan, np.nan, np.nan, np.nan, None, 0, "", 0.0)
            for c in design
            if json.dumps(c) not in ran
        ]
        outcomes.sort(key=lambda o: order.index(json.dumps(o.cell)))
        minutes = sum(o.seconds for o in outcomes) / 60
        num_cells = sum(o.cell in design and o.verdict != "not run" for o in outcomes)
    else:
        print(
            f"design: {len(design)} cells (running {len(cells)}), {len(probes)} refusal probes",
            flush=True,
        )
        start, outcomes = time.perf_counter(), []
        for i, cell in enumerate(cells + probes, 1):
            outcomes.append(
                run_cell_isolated(cell, options.timeout) if options.timeout else run_cell(cell)
            )
            print(row(i, outcomes[-1]), flush=True)
            if options.rows:
                with open(options.rows, "a") as f:
                    f.write(json.dumps(outcomes[-1]._asdict(), default=str) + "\n")
        minutes, num_cells = (time.perf_counter() - start) / 60, len(cells)
    num_probes = sum(o.cell not in design for o in outcomes)
    header = (
        f"Sweep of {datetime.date.today()} at commit {git_commit()}: {num_cells} of {len(design)} "
        f"design cells and {num_probes} refusal probes in {minutes:.1f} min on {os.cpu_count()} "
        f"CPU cores (rounds <= {NUM_ROUNDS}, tol = {TOL})."
    )
    text = table(outcomes, header)
    print(text)
    if options.out:
        write_table(options.out, text)


BEGIN, END = "<!-- sweep: begin -->", "<!-- sweep: end -->"


def write_table(path: Path, text: str) -> None:
    """Replace the table between the sweep markers of ``path`` (or write the file if it has
    none)."""
    old = path.read_text() if path.exists() else ""
    if BEGIN in old and END in old:
        new = old[: old.index(BEGIN) + len(BEGIN)] + "\n" + text + old[old.index(END) :]
    else:
        new = old + f"\n{BEGIN}\n{text}{END}\n"
    path.write_text(new)


if __name__ == "__main__":
    sys.exit(main())
