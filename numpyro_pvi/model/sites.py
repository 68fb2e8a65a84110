"""Reading a model: which sites are global latents, likelihoods, local latents and hyperparameters.

PVI's factors live in the unconstrained space of the global latent sites, flattened into one vector
``zeta`` of size ``D`` in model order (like ``AutoDiagonalNormal``), never in ``ravel_pytree``'s
sorted-key order. Unobserved sites inside the partition plate are *local latents*: continuous ones
get a client-private guide, discrete ones marked for enumeration are summed out
(``TraceEnum_ELBO``). ``numpyro.param`` sites outside the partition plate are *hyperparameters*,
learned as point estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.distributions.transforms import (
    Transform,
    biject_to,
)
from numpyro.infer.inspect import get_model_relations

from numpyro_pvi.model.partition import NESTED_TAG, PARTITION_TAG
from numpyro_pvi.model.trace import compiled_trace, read_shapes


@dataclass(frozen=True)
class GlobalSite:
    """A global latent site: its constrained value ``shape`` and its unconstrained
    ``flat_shape``."""

    name: str
    shape: tuple
    flat_shape: tuple
    transform: Transform

    @property
    def size(self) -> int:
        return int(np.prod(self.flat_shape, dtype=np.int64))


@dataclass(frozen=True)
class LocalSite:
    """A continuous local latent site (inside the partition plate), as one client's model call sees
    it.

    :ivar shape: constrained value shape (with the client's rows on the partition plate's axis).
    :ivar flat_shape: unconstrained shape, where the client's guide lives.
    :ivar event_dim: event dimensions of the unconstrained value.
    :ivar frames: ``(name, size, dim)`` of every plate the site is in (to rebuild them in a guide).
    :ivar row_axis: the (negative) axis of the unconstrained value that indexes the partition
        plate's rows.
    """

    name: str
    shape: tuple
    flat_shape: tuple
    transform: Transform
    event_dim: int
    frames: tuple
    row_axis: int


@dataclass(frozen=True)
class HyperSite:
    """A hyperparameter: a ``numpyro.param`` site outside the partition plate, learned as a point
    estimate.

    :ivar init: its initial value in unconstrained space.
    :ivar transform: ``biject_to(constraint)``, unconstrained -> constrained.
    """

    name: str
    init: Any
    transform: Transform


@dataclass(frozen=True)
class ObservedSite:
    """An observed site in the partition plate: its likelihood's ``support``, and ``source``, the
    position of the array argument (among the array arguments) its values are, or ``None`` if the
    model computes them."""

    name: str
    support: Any
    source: int | None


@dataclass(frozen=True)
class ModelSites:
    """What PVI needs to know about a model, read once from a trace.

    :ivar plate: name of the partition plate.
    :ivar plate_size: its size in the traced call.
    :ivar globals: global latent sites, in model order.
    :ivar likelihoods: names of the observed sites inside the partition plate.
    :ivar gaussian_prior: for each global site whose prior is Gaussian in unconstrained space with
        fixed parameters, ``(loc, precision)``: flat loc ``(size,)`` and a diagonal ``(size,)`` or
        full ``(size, size)`` precision. The other sites' priors are fitted by a prior factor.
    :ivar locals: continuous local latent sites (:class:`LocalSite`), in model order.
    :ivar enumerated: names of the discrete local latent sites marked for enumeration.
    :ivar hyper: hyperparameters (:class:`HyperSite`), in model order.
    :ivar observed: the observed sites (:class:`ObservedSite`), in model order.
    """

    plate: str
    plate_size: int
    globals: tuple
    likelihoods: tuple
    gaussian_prior: dict
    locals: tuple = ()
    enumerated: tuple = ()
    hyper: tuple = ()
    observed: tuple = ()

    @property
    def has_local(self) -> bool:
        """Whether clients have local latents (continuous or enumerated)."""
        return bool(self.locals or self.enumerated)

    def hyper_values(self, hyper: dict) -> dict:
        """Unconstrained hyperparameters -> constrained values, by name."""
        return {h.name: h.transform(hyper[h.name]) for h in self.hyper}

    def values(self, zeta: jax.Array, hyper: dict | tuple = ()) -> dict:
        """The global sites' values ``theta(zeta)`` and, if given, the hyperparameters', by name."""
        values = self.unflatten(zeta)
        if hyper:
            values.update(self.hyper_values(hyper))
        return values

    @property
    def dim(self) -> int:
        """Size ``D`` of the flat unconstrained vector."""
        return sum(s.size for s in self.globals)

    def unflatten(self, zeta: jax.Array) -> dict:
        """Flat unconstrained ``(D,)`` vector -> dict of constrained values of the global sites."""
        values, start = {}, 0
        for site in self.globals:
            u = jnp.reshape(zeta[start : start + site.size], site.flat_shape)
            values[site.name] = site.transform(u)
            start += site.size
        return values

    def flatten(self, values: dict) -> jax.Array:
        """Dict of constrained values -> flat unconstrained ``(D,)`` vector."""
        return jnp.concatenate(
            [jnp.reshape(s.transform.inv(values[s.name]), (-1,)) for s in self.globals]
        )

    def slices(self) -> dict:
        """Name -> ``slice`` of the site in the flat vector."""
        out, start = {}, 0
        for site in self.globals:
            out[site.name] = slice(start, start + site.size)
            start += site.size
        return out


def read_model(model: Callable, args: tuple, kwargs: dict, who: str = "The data") -> ModelSites:
    """Trace ``model(*args, **kwargs)`` once (one compiled call) and classify its sites; raise on
    what PVI cannot handle.

    :param who: names the data in errors, e.g. ``"Client 3's data"``.
    """
    trace, blocks, values_ok = compiled_trace(model, args, kwargs, who)
    plate = _partition_plate(trace)
    kinds = _classify(trace, plate)
    if not kinds["likelihoods"]:
        raise ValueError(
            f"partition_plate '{plate}' holds no observed site: put the likelihood (obs=...) "
            "inside it."
        )
    if not kinds["globals"]:
        raise ValueError(
            "The model has no global latent site outside the partition plate: nothing to infer."
        )
    for name in kinds["likelihoods"]:
        check_observed(name, trace[name], *values_ok[name], who)
    observed = tuple(
        ObservedSite(n, trace[n]["fn"].support, trace[n]["source"]) for n in kinds["likelihoods"]
    )
    gaussian = _gaussian_prior(
        get_model_relations(model, args, kwargs), kinds["globals"], kinds["hyper"], blocks
    )
    return ModelSites(
        plate,
        int(trace[plate]["args"][0]),
        *(tuple(kinds[k]) for k in ("globals", "likelihoods")),
        gaussian,
        *(tuple(kinds[k]) for k in ("locals", "enumerated", "hyper")),
        observed,
    )


def check_observed(name: str, site: dict, finite: bool, in_support: bool, who: str) -> None:
    """Raise a ``ValueError`` naming the site if its values are not finite or outside the
    likelihood's support."""
    if not finite:
        raise ValueError(
            f"{who}: observed site '{name}' holds NaN or inf values; remove or impute those rows."
        )
    if not in_support:
        raise ValueError(
            f"{who}: observed site '{name}' has values outside the support of its likelihood "
            f"({site['fn'].support}), e.g. Bernoulli labels must be 0 or 1."
        )


def _partition_plate(trace: dict) -> str:
    """The name of the model's one partition plate (with no subsampling)."""
    for name, site in trace.items():
        if site["type"] == "sample" and NESTED_TAG in (site.get("infer") or {}):
            outer, inner = site["infer"][NESTED_TAG]
            raise ValueError(
                f"partition_plate '{outer}' holds another partition_plate, '{inner}' (around site "
                f"'{name}'): PVI partitions one plate. Keep the plate whose rows are split across "
                f"clients as the partition plate and make '{inner}' or '{outer}' a numpyro.plate "
                "(a numpyro.plate inside the partition plate is supported)."
            )
    plates = {
        s["infer"].get(PARTITION_TAG)
        for s in trace.values()
        if s["type"] == "sample" and s.get("infer") and PARTITION_TAG in s["infer"]
    }
    if not plates:
        raise ValueError(
            "The model has no pvi.partition_plate around its observed data: mark the plate that "
            "holds the data with `with pvi.partition_plate(name, size): ...`."
        )
    if len(plates) > 1:
        raise ValueError(
            f"The model has several partition plates {sorted(plates)}; PVI partitions exactly one."
        )
    plate = plates.pop()
    size, subsample_size = trace[plate]["args"]
    if subsample_size is not None and subsample_size != size:
        raise ValueError(
            f"partition_plate '{plate}' uses subsample_size={subsample_size}; under PVI use "
            "GradientUpdate(batch_size=...) for mini-batches instead."
        )
    return plate


def _classify(trace: dict, plate: str) -> dict:
    """The trace's sites by kind: ``globals``, ``likelihoods``, ``locals``, ``enumerated``,
    ``hyper`` (model order)."""
    kinds: dict = {"globals": [], "likelihoods": [], "locals": [], "enumerated": [], "hyper": []}
    for name, site in trace.items():
        in_plate = any(f.name == plate for f in site.get("cond_indep_stack", ()))
        if site["type"] == "param":
            kinds["hyper"].append(_hyper_site(name, site, in_plate, plate))
        elif site["type"] != "sample":
            continue
        elif site["is_observed"]:
            if not in_plate:
                raise NotImplementedError(
                    f"Observed site '{name}' is outside partition plate '{plate}'; PVI splits "
                    "only the observations inside the partition plate."
                )
            _check_observed_shape(name, site, plate)
            kinds["likelihoods"].append(name)
        elif in_plate and site["fn"].support.is_discrete:
            if (site.get("infer") or {}).get("enumerate") != "parallel":
                raise ValueError(
                    f"Local latent site '{name}' is discrete: mark it for enumeration "
                    f"(numpyro.infer.config_enumerate or infer={{'enumerate': 'parallel'}}) so "
                    "that clients sum it out with TraceEnum_ELBO."
                )
            kinds["enumerated"].append(name)
        elif in_plate:
            kinds["locals"].append(_local_site(name, site, plate))
        elif site["fn"].improper:
            raise ValueError(
                f"Global site '{name}' has an improper prior ({site['fn'].support}); PVI's "
                "factors need a proper prior: give it a proper distribution (e.g. a wide Normal)."
            )
        elif site["fn"].support.is_discrete:
            raise ValueError(
                f"Global site '{name}' has a discrete support ({site['fn'].support}); PVI's "
                "factors are Gaussian in unconstrained space, so global latents must be "
                "continuous."
            )
        else:
            transform = biject_to(site["fn"].support)
            shape = tuple(site["value"].shape)
            kinds["globals"].append(
                GlobalSite(name, shape, tuple(transform.inverse_shape(shape)), transform)
            )
    return kinds


def _check_observed_shape(name: str, site: dict, plate: str) -> None:
    """An observed site has one likelihood term per row of its plates: no nested copies of the
    partition plate, and no observations that broadcast against the batch (``y`` of shape ``(n, 1)``
    under a plate of ``n``)."""
    frames = site["cond_indep_stack"]
    if sum(f.name == plate for f in frames) > 1:
        raise ValueError(
            f"Observed site '{name}' is inside partition plate '{plate}' more than once (nested "
            "plates with the same name): use the partition plate once."
        )
    rows = int(np.prod([f.size for f in frames], dtype=np.int64))
    terms = int(np.prod(site["fn"].log_prob_shape, dtype=np.int64))
    if terms > rows:
        raise ValueError(
            f"Observed site '{name}' has {terms} likelihood terms for {rows} rows of its plates: "
            f"its value of shape {tuple(site['value'].shape)} broadcasts against the "
            "distribution's batch shape (e.g. y of shape (n, 1) under a plate of size n). Pass y "
            "of shape (n,), or declare the extra dimensions with .to_event() or an inner plate."
        )


def _hyper_site(name: str, site: dict, in_plate: bool, plate: str) -> HyperSite:
    if in_plate:
        raise ValueError(
            f"numpyro.param site '{name}' is inside partition plate '{plate}': a per-row "
            "parameter would belong to one client only. Make it a local latent (a sample site "
            "with a prior) or move it outside the plate to learn it as a hyperparameter."
        )
    transform = biject_to(site["kwargs"].get("constraint", constraints.real))
    return HyperSite(name, transform.inv(site["value"]), transform)


def _gaussian_prior(relations: dict, global_sites: list, hyper: list, blocks: dict) -> dict:
    """The Gaussian prior blocks of the global sites whose prior has fixed parameters (no latent
    parent)."""
    parents, names = relations.get("sample_sample", {}), {s.name for s in global_sites}
    for site in global_sites if hyper else ():
        used = set(relations.get("sample_param", {}).get(site.name, ())) & {h.name for h in hyper}
        if used:
            raise NotImplementedError(
                f"Hyperparameter(s) {sorted(used)} enter the prior of global site '{site.name}'; "
                "PVI learns hyperparameters of the likelihood and of local latents only. Give "
                "them a prior (make them global latent sites) instead."
            )
    return {
        s.name: blocks[s.name]
        for s in global_sites
        if names.isdisjoint(parents.get(s.name, ())) and s.name in blocks
    }


def read_padded(
    model: Callable,
    sites: ModelSites,
    args: tuple,
    kwargs: dict,
    rows: int,
    who: str = "Client 0's data",
) -> ModelSites:
    """``sites`` as a padded client's model call (``rows`` rows) sees them (an abstract trace, no
    computation).

    Checks that the partition plate has ``rows`` rows in that call and reads the local sites'
    shapes.
    """
    size, local_sites = plate_and_locals(model, sites, args, kwargs, who)
    if size != rows:
        raise ValueError(
            f"partition_plate '{sites.plate}' has size {size} in a client's model call with "
            f"{rows} rows: size the plate from the data (e.g. X.shape[0])."
        )
    return replace(sites, plate_size=rows, locals=local_sites)


def plate_and_locals(
    model: Callable, sites: ModelSites, args: tuple, kwargs: dict, who: str
) -> tuple[int, tuple]:
    """The partition plate's size and the local sites in ``model(*args, **kwargs)``, traced
    abstractly."""
    trace = read_shapes(model, args, kwargs, who)
    return trace[sites.plate]["args"][0], tuple(
        _local_site(s.name, trace[s.name], sites.plate) for s in sites.locals
    )


def _local_site(name: str, site: dict, plate: str) -> LocalSite:
    transform = biject_to(site["fn"].support)
    shape = tuple(site["value"].shape)
    flat_shape = tuple(transform.inverse_shape(shape))
    event_dim = site["fn"].event_dim + len(flat_shape) - len(shape)
    frames = tuple((f.name, f.size, f.dim) for f in site["cond_indep_stack"])
    plate_dim = next(f.dim for f in site["cond_indep_stack"] if f.name == plate)
    return LocalSite(name, shape, flat_shape, transform, event_dim, frames, plate_dim - event_dim)
