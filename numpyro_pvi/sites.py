"""Reading a model: which sites are global latents, likelihoods, local latents and hyperparameters.

PVI's factors live in the unconstrained space of the global latent sites, flattened into one vector
``zeta`` of size ``D`` in model order (like ``AutoDiagonalNormal``), never in ``ravel_pytree``'s
sorted-key order. Unobserved sites inside the partition plate are *local latents*: continuous ones
get a client-private guide, discrete ones marked for enumeration are summed out (``TraceEnum_ELBO``).
``numpyro.param`` sites outside the partition plate are *hyperparameters*, learned as point estimates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import (
    ExpTransform,
    IdentityTransform,
    IndependentTransform,
    Transform,
    biject_to,
)
from numpyro.infer.inspect import get_model_relations
from numpyro.primitives import Messenger

from numpyro_pvi.partition import PARTITION_TAG


@dataclass(frozen=True)
class GlobalSite:
    """A global latent site: its constrained value ``shape`` and its unconstrained ``flat_shape``."""

    name: str
    shape: tuple
    flat_shape: tuple
    transform: Transform

    @property
    def size(self) -> int:
        return int(np.prod(self.flat_shape, dtype=np.int64))


@dataclass(frozen=True)
class LocalSite:
    """A continuous local latent site (inside the partition plate), as one client's model call sees it.

    :ivar shape: constrained value shape (with the client's rows on the partition plate's axis).
    :ivar flat_shape: unconstrained shape, where the client's guide lives.
    :ivar event_dim: event dimensions of the unconstrained value.
    :ivar frames: ``(name, size, dim)`` of every plate the site is in (to rebuild them in a guide).
    :ivar row_axis: the (negative) axis of the unconstrained value that indexes the partition plate's rows.
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
    """A hyperparameter: a ``numpyro.param`` site outside the partition plate, learned as a point estimate.

    :ivar init: its initial value in unconstrained space.
    :ivar transform: ``biject_to(constraint)``, unconstrained -> constrained.
    """

    name: str
    init: Any
    transform: Transform


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
    """

    plate: str
    plate_size: int
    globals: tuple
    likelihoods: tuple
    gaussian_prior: dict
    locals: tuple = ()
    enumerated: tuple = ()
    hyper: tuple = ()

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
            u = jnp.reshape(zeta[start:start + site.size], site.flat_shape)
            values[site.name] = site.transform(u)
            start += site.size
        return values

    def flatten(self, values: dict) -> jax.Array:
        """Dict of constrained values -> flat unconstrained ``(D,)`` vector."""
        return jnp.concatenate([jnp.reshape(s.transform.inv(values[s.name]), (-1,)) for s in self.globals])

    def slices(self) -> dict:
        """Name -> ``slice`` of the site in the flat vector."""
        out, start = {}, 0
        for site in self.globals:
            out[site.name] = slice(start, start + site.size)
            start += site.size
        return out


def read_model(model: Callable, args: tuple, kwargs: dict, rng_key: jax.Array, relations: bool = True,
               who: str = "The data") -> ModelSites:
    """Trace ``model(*args, **kwargs)`` once and classify its sites; raise on what PVI cannot handle.

    :param relations: also find which priors are Gaussian in unconstrained space (one more trace).
    :param who: names the data in errors, e.g. ``"Client 3's data"``.
    """
    trace = _checked_trace(model, args, kwargs, rng_key, who)
    plates = {s["infer"].get(PARTITION_TAG) for s in trace.values()
              if s["type"] == "sample" and s.get("infer") and PARTITION_TAG in s["infer"]}
    if not plates:
        raise ValueError("The model has no pvi.partition_plate around its observed data: mark the plate that "
                         "holds the data with `with pvi.partition_plate(name, size): ...`.")
    if len(plates) > 1:
        raise ValueError(f"The model has several partition plates {sorted(plates)}; PVI partitions exactly one.")
    plate = plates.pop()
    size, subsample_size = trace[plate]["args"]
    if subsample_size is not None and subsample_size != size:
        raise ValueError(f"partition_plate '{plate}' uses subsample_size={subsample_size}; under PVI use "
                         "GradientUpdate(batch_size=...) for mini-batches instead.")

    global_sites, likelihoods, local_sites, enumerated, hyper = [], [], [], [], []
    for name, site in trace.items():
        in_plate = any(f.name == plate for f in site.get("cond_indep_stack", ()))
        if site["type"] == "param":
            if in_plate:
                raise ValueError(f"numpyro.param site '{name}' is inside partition plate '{plate}': a per-row "
                                 "parameter would belong to one client only. Make it a local latent (a sample "
                                 "site with a prior) or move it outside the plate to learn it as a hyperparameter.")
            constraint = site["kwargs"].get("constraint", constraints.real)
            transform = biject_to(constraint)
            hyper.append(HyperSite(name, transform.inv(jnp.asarray(site["value"])), transform))
            continue
        if site["type"] != "sample":
            continue
        if site["is_observed"]:
            if not in_plate:
                raise NotImplementedError(f"Observed site '{name}' is outside partition plate '{plate}'; PVI splits "
                                          "only the observations inside the partition plate.")
            likelihoods.append(name)
            continue
        if in_plate:
            if site["fn"].support.is_discrete:
                if (site.get("infer") or {}).get("enumerate") != "parallel":
                    raise ValueError(f"Local latent site '{name}' is discrete: mark it for enumeration "
                                     "(numpyro.infer.config_enumerate or infer={'enumerate': 'parallel'}) so that "
                                     "clients sum it out with TraceEnum_ELBO.")
                enumerated.append(name)
            else:
                local_sites.append(_local_site(name, site, plate))
            continue
        if site["fn"].support.is_discrete:
            raise ValueError(f"Global site '{name}' has a discrete support ({site['fn'].support}); PVI's factors "
                             "are Gaussian in unconstrained space, so global latents must be continuous.")
        transform = biject_to(site["fn"].support)
        shape = tuple(jnp.shape(site["value"]))
        global_sites.append(GlobalSite(name, shape, tuple(transform.inverse_shape(shape)), transform))
    if not likelihoods:
        raise ValueError(f"partition_plate '{plate}' holds no observed site: put the likelihood (obs=...) inside it.")
    if not global_sites:
        raise ValueError("The model has no global latent site outside the partition plate: nothing to infer.")

    model_relations = get_model_relations(model, args, kwargs) if relations else {}
    parents = model_relations.get("sample_sample", {})
    names = {s.name for s in global_sites}
    for site in global_sites if hyper else ():
        used = set(model_relations.get("sample_param", {}).get(site.name, ())) & {h.name for h in hyper}
        if used:
            raise NotImplementedError(f"Hyperparameter(s) {sorted(used)} enter the prior of global site '{site.name}'; "
                                      "PVI learns hyperparameters of the likelihood and of local latents only. Give "
                                      "them a prior (make them global latent sites) instead.")
    gaussian = {}
    for site in global_sites if relations else ():
        if names.isdisjoint(parents.get(site.name, ())):
            block = _gaussian_block(trace[site.name]["fn"], site)
            if block is not None:
                gaussian[site.name] = block
    return ModelSites(plate, int(size), tuple(global_sites), tuple(likelihoods), gaussian, tuple(local_sites),
                      tuple(enumerated), tuple(hyper))


def _checked_trace(model: Callable, args: tuple, kwargs: dict, rng_key: jax.Array, who: str) -> dict:
    """The model's trace on these data, its observed densities evaluated (which catches observations of the
    wrong shape); any failure of the user's model on the data is a ``ValueError`` naming ``who``."""
    try:
        trace = handlers.trace(handlers.seed(model, rng_key)).get_trace(*args, **kwargs)
        for site in trace.values():
            if site["type"] == "sample" and site["is_observed"]:
                _site_log_prob(site)
    except Exception as e:  # noqa: BLE001 - any failure of the user's model on these data is reported as such
        raise ValueError(f"{who} does not fit the model: {type(e).__name__}: {e}. (The partition plate must be "
                         "sized from the data, e.g. X.shape[0], and every row argument must have that many "
                         "rows.)") from e
    return trace


def read_shapes(model: Callable, sites: ModelSites, args: tuple, kwargs: dict,
                who: str = "The data") -> tuple[int, tuple]:
    """The partition plate's size and the local sites in ``model(*args, **kwargs)``, traced abstractly.

    ``jax.eval_shape`` runs the model on shapes alone: nothing is computed or compiled, yet a data set that
    does not fit the model raises (a ``ValueError`` naming ``who``) as a concrete trace would.
    """
    found: dict = {}
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (np.ndarray, jax.Array))]

    def trace_once(*values: jax.Array) -> jax.Array:
        full = list(leaves)
        for i, value in zip(arrays, values):
            full[i] = value
        c_args, c_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        trace = _checked_trace(model, c_args, c_kwargs, jax.random.PRNGKey(0), who)
        found["size"] = trace[sites.plate]["args"][0]
        found["locals"] = tuple(_local_site(s.name, trace[s.name], sites.plate) for s in sites.locals)
        return jnp.zeros(())

    jax.eval_shape(trace_once, *[leaves[i] for i in arrays])
    return found["size"], found["locals"]


def read_padded(model: Callable, sites: ModelSites, args: tuple, kwargs: dict, rows: int) -> ModelSites:
    """``sites`` as a padded client's model call (``rows`` rows) sees them (an abstract trace, no computation).

    Checks that the partition plate has ``rows`` rows in that call and reads the local sites' shapes.
    """
    size, local_sites = read_shapes(model, sites, args, kwargs, who="Client 0's data")
    if size != rows:
        raise ValueError(f"partition_plate '{sites.plate}' has size {size} in a client's model call with "
                         f"{rows} rows: size the plate from the data (e.g. X.shape[0]).")
    return ModelSites(sites.plate, rows, sites.globals, sites.likelihoods, sites.gaussian_prior, local_sites,
                      sites.enumerated, sites.hyper)


def _local_site(name: str, site: dict, plate: str) -> LocalSite:
    transform = biject_to(site["fn"].support)
    shape = tuple(jnp.shape(site["value"]))
    flat_shape = tuple(transform.inverse_shape(shape))
    event_dim = site["fn"].event_dim + len(flat_shape) - len(shape)
    frames = tuple((f.name, f.size, f.dim) for f in site["cond_indep_stack"])
    plate_dim = next(f.dim for f in site["cond_indep_stack"] if f.name == plate)
    return LocalSite(name, shape, flat_shape, transform, event_dim, frames, plate_dim - event_dim)


def _gaussian_block(fn: dist.Distribution, site: GlobalSite) -> tuple | None:
    """``(loc, precision)`` of a prior that is Gaussian in unconstrained space, else ``None``."""
    base, transform = fn, site.transform
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution)):
        base = base.base_dist
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    if isinstance(base, dist.LogNormal) and isinstance(transform, ExpTransform):
        base = base.base_dist
    elif isinstance(base, dist.TransformedDistribution) or not isinstance(transform, IdentityTransform):
        return None
    if isinstance(base, dist.Normal):
        loc = jnp.broadcast_to(base.loc, site.flat_shape).reshape(-1)
        scale = jnp.broadcast_to(base.scale, site.flat_shape).reshape(-1)
        return loc, 1.0 / scale**2
    if isinstance(base, dist.MultivariateNormal) and base.batch_shape == () and site.flat_shape == base.event_shape:
        return base.loc, base.precision_matrix
    return None


# ----------------------------------------------------------------------------- densities in zeta


class PlateMask(Messenger):
    """Mask the sites inside plate ``plate`` with a ``(rows,)`` boolean ``mask`` (padding for ``vmap``)."""

    def __init__(self, fn: Callable | None = None, plate: str = "", mask: jax.Array | None = None) -> None:
        self.plate, self.mask = plate, mask
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or self.mask is None:
            return
        for frame in msg["cond_indep_stack"]:
            if frame.name == self.plate:
                msg["fn"] = msg["fn"].mask(jnp.reshape(self.mask, (-1,) + (1,) * (-frame.dim - 1)))
                return


def _site_log_prob(site: dict) -> jax.Array:
    log_prob = site["fn"].log_prob(site["value"])
    if site["scale"] is not None:
        log_prob = site["scale"] * log_prob
    return jnp.sum(log_prob)


def log_likelihood(model: Callable, sites: ModelSites, zeta: jax.Array, args: tuple, kwargs: dict,
                   mask: jax.Array | None = None, hyper: dict | tuple = ()) -> jax.Array:
    """``log p(y_m | theta(zeta))`` of one client's rows: a scalar, masked rows contribute 0.

    :param hyper: unconstrained values of the hyperparameters (default: their initial values).
    """
    values = sites.values(zeta, hyper)
    masked = PlateMask(handlers.substitute(model, data=values), plate=sites.plate, mask=mask)
    with handlers.block():  # block *outside* trace: the inner sites must not leak into an outer ELBO
        trace = handlers.trace(masked).get_trace(*args, **kwargs)
    return sum(_site_log_prob(trace[name]) for name in sites.likelihoods)


def local_model(model: Callable, sites: ModelSites, zeta: jax.Array, args: tuple, kwargs: dict,
                mask: jax.Array | None = None, hyper: dict | tuple = ()) -> None:
    """Run the model with its global sites set to ``theta(zeta)`` and its hyperparameters to ``hyper``.

    The global and param sites are hidden from outer handlers (their prior is the cavity's business),
    so an outer ELBO sees only the client's local latents and observations, masked rows weighing 0.
    Use it inside a tilted model whose ``_pvi_zeta`` site carries the cavity.
    """
    values = sites.values(zeta, hyper)
    hidden = [s.name for s in sites.globals] + [h.name for h in sites.hyper]
    hidden_model = handlers.block(handlers.substitute(model, data=values), hide=hidden)
    PlateMask(hidden_model, plate=sites.plate, mask=mask)(*args, **kwargs)


def log_prior(model: Callable, sites: ModelSites, zeta: jax.Array, args: tuple, kwargs: dict,
              names: Any = None) -> jax.Array:
    """``log p(theta(zeta)) + log|d theta / d zeta|``: the prior density in unconstrained space.

    :param names: restrict the sum to these global sites (default: all).
    """
    values = sites.unflatten(zeta)
    substituted = handlers.substitute(model, data=values)
    if sites.has_local:  # local latents are drawn (and ignored): they need a key
        substituted = handlers.seed(substituted, jax.random.PRNGKey(0))
    with handlers.block():
        trace = handlers.trace(substituted).get_trace(*args, **kwargs)
    total = 0.0
    for site, start in zip(sites.globals, np.cumsum([0] + [s.size for s in sites.globals])):
        if names is not None and site.name not in names:
            continue
        u = jnp.reshape(zeta[start:start + site.size], site.flat_shape)
        jac = site.transform.log_abs_det_jacobian(u, values[site.name])
        total = total + _site_log_prob(trace[site.name]) + jnp.sum(jac)
    return total
