"""Tracing the user's model to read it: one compiled call, no eager operation, cached by data
structure.

Reading a model needs its sites' types, plates, shapes and supports (static), and a few values: the
hyperparameters' initial values and the parameters of priors that are Gaussian in unconstrained
space. Tracing the model eagerly would compile every operation it makes (a BNN's first ``init``
spent 20 s on that); :func:`compiled_trace` instead runs the model once under ``jax.jit``, records
the static part of the trace while tracing, and returns the values as the call's outputs. The jitted
reader is cached by the model and the data's structure, so re-reading data of the same shapes
neither traces nor compiles.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions.transforms import (
    ExpTransform,
    IdentityTransform,
    IndependentTransform,
    biject_to,
)
from numpyro.infer.initialization import init_to_sample

READ_SEED = 0


class SiteFn(NamedTuple):
    """What PVI reads of a sample site's distribution (no arrays).

    :ivar support: its support; ``event_dim`` its event dimensions.
    :ivar improper: whether it is an improper density (``ImproperUniform``), which no factor can
        represent.
    :ivar log_prob_shape: the shape of its ``log_prob`` at the traced value (observed sites: one
        entry per observation, so more entries than the plates' rows mean the value broadcast
        against the batch).
    """

    support: Any
    event_dim: int
    improper: bool = False
    log_prob_shape: tuple = ()


def site_log_prob(site: dict) -> jax.Array:
    """The summed (scaled) log density of a traced sample site."""
    log_prob = site["fn"].log_prob(site["value"])
    if site["scale"] is not None:
        log_prob = site["scale"] * log_prob
    return jnp.sum(log_prob)


def checked_trace(model: Callable, args: tuple, kwargs: dict, who: str) -> dict:
    """The model's trace on these data, its observed densities evaluated (which catches observations
    of the wrong shape); any failure of the user's model on the data is a ``ValueError`` naming
    ``who``."""
    try:
        # init_to_sample draws latent values as NumPyro's inference does (also for an
        # ImproperUniform site)
        seeded = handlers.substitute(
            handlers.seed(model, jax.random.PRNGKey(READ_SEED)), substitute_fn=init_to_sample
        )
        trace = handlers.trace(seeded).get_trace(*args, **kwargs)
        for site in trace.values():
            if site["type"] == "sample" and site["is_observed"]:
                site_log_prob(site)
    except Exception as e:  # noqa: BLE001 - any failure of the user's model on these data is reported as such
        raise ValueError(
            f"{who} does not fit the model: {type(e).__name__}: {e}. (The partition plate must be "
            "sized from the data, e.g. X.shape[0], and every row argument must have that many "
            "rows.)"
        ) from e
    return trace


def gaussian_block(fn: dist.Distribution, transform: Any, flat_shape: tuple) -> tuple | None:
    """``(loc, precision)`` of a prior that is Gaussian in unconstrained space, else ``None``."""
    base = fn
    while isinstance(base, (dist.Independent, dist.ExpandedDistribution)):
        base = base.base_dist
    while isinstance(transform, IndependentTransform):
        transform = transform.base_transform
    if isinstance(base, dist.LogNormal) and isinstance(transform, ExpTransform):
        base = base.base_dist
    elif isinstance(base, dist.TransformedDistribution) or not isinstance(
        transform, IdentityTransform
    ):
        return None
    if isinstance(base, dist.Normal):
        loc = jnp.broadcast_to(base.loc, flat_shape).reshape(-1)
        scale = jnp.broadcast_to(base.scale, flat_shape).reshape(-1)
        return loc, 1.0 / scale**2
    if (
        isinstance(base, dist.MultivariateNormal)
        and base.batch_shape == ()
        and flat_shape == base.event_shape
    ):
        return base.loc, base.precision_matrix
    return None


def compiled_trace(model: Callable, args: tuple, kwargs: dict, who: str) -> tuple[dict, dict, dict]:
    """``(trace, blocks, observed)``: the model's trace with static entries only (``fn`` a
    :class:`SiteFn`, sample values as ``jax.ShapeDtypeStruct``, param values concrete), the Gaussian
    prior blocks ``site -> (loc, precision)`` of the sample sites whose prior is Gaussian in
    unconstrained space, and for each observed site ``(all finite, all in support)`` of its values.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    positions = tuple(i for i, x in enumerate(leaves) if isinstance(x, (np.ndarray, jax.Array)))
    static = tuple((i, x) for i, x in enumerate(leaves) if i not in positions)
    arrays = [leaves[i] for i in positions]
    try:
        reader = _reader(model, treedef, static, who)
    except TypeError:  # unhashable static arguments: an uncached reader
        reader = _reader.__wrapped__(model, treedef, static, who)
    values = reader.jitted(*arrays)
    shape_key = _shape_key(arrays)
    trace = dict(reader.static[shape_key])
    # a support or constraint built from the data: read eagerly
    if trace.pop(_TRACED_SUPPORT, False):
        eager = checked_trace(model, args, kwargs, who)
        trace, params, blocks = _static_trace(eager)
        trace.pop(_TRACED_SUPPORT, None)
        values = {"params": params, "blocks": blocks, "observed": _observed_checks(eager)}
    for name, value in values["params"].items():
        trace[name] = {**trace[name], "value": value}
    observed = {
        name: (bool(finite), bool(inside)) for name, (finite, inside) in values["observed"].items()
    }
    return trace, values["blocks"], observed


def _shape_key(arrays: Any) -> tuple:
    """The shapes and (canonical) dtypes of the reader's arguments: what its compilation depends
    on."""
    return tuple((tuple(a.shape), jax.dtypes.canonicalize_dtype(a.dtype)) for a in arrays)


# marks a static trace whose supports depend on the traced data
_TRACED_SUPPORT = "_pvi_traced_support"


class _Reader(NamedTuple):
    jitted: Callable
    static: dict  # shapes of the arrays -> the static part of the trace traced for them


@functools.lru_cache(maxsize=32)
def _reader(model: Callable, treedef: Any, static: tuple, who: str) -> _Reader:
    recorded: dict = {}

    fixed = dict(static)

    def read(*arrays: jax.Array) -> dict:
        free = iter(arrays)
        leaves = [fixed[i] if i in fixed else next(free) for i in range(len(arrays) + len(fixed))]
        args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
        trace = checked_trace(model, args, kwargs, who)
        shape_key = _shape_key(arrays)
        recorded[shape_key], params, blocks = _static_trace(
            trace, {id(a): i for i, a in enumerate(arrays)}
        )
        return {"params": params, "blocks": blocks, "observed": _observed_checks(trace)}

    return _Reader(jax.jit(read), recorded)


def _observed_checks(trace: dict) -> dict:
    """For each observed site: whether its values are all finite and all in the likelihood's
    support."""
    return {
        name: (jnp.all(jnp.isfinite(site["value"])), jnp.all(site["fn"].support(site["value"])))
        for name, site in trace.items()
        if site["type"] == "sample" and site["is_observed"]
    }


def _improper(fn: dist.Distribution) -> bool:
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        fn = fn.base_dist
    return isinstance(fn, dist.ImproperUniform)


def _static_trace(trace: dict, sources: dict | None = None) -> tuple[dict, dict, dict]:
    """The trace's static entries, the param sites' values and the sample sites' Gaussian prior
    blocks.

    :param sources: ``id`` of each array argument -> its position: an observed site whose value *is*
        an argument records it as ``source`` (so that every client's observations can be checked by
        value).
    """
    out, params, blocks = {}, {}, {}
    for name, site in trace.items():
        entry = {
            k: site[k]
            for k in ("type", "is_observed", "infer", "cond_indep_stack", "args", "kwargs", "scale")
            if k in site
        }
        if site["type"] == "sample":
            fn = site["fn"]
            log_prob_shape = (
                tuple(jnp.shape(fn.log_prob(site["value"]))) if site["is_observed"] else ()
            )
            entry["fn"] = SiteFn(fn.support, fn.event_dim, _improper(fn), log_prob_shape)
            entry["value"] = jax.ShapeDtypeStruct(
                jnp.shape(site["value"]), jnp.result_type(site["value"])
            )
            entry["source"] = (
                (sources or {}).get(id(site["value"])) if site["is_observed"] else None
            )
            entry["scale"] = None
            if not site["is_observed"] and not site["fn"].support.is_discrete:
                transform = biject_to(site["fn"].support)
                shape = jnp.shape(site["value"])
                block = gaussian_block(site["fn"], transform, tuple(transform.inverse_shape(shape)))
                if block is not None:
                    blocks[name] = block
        elif site["type"] == "param":
            params[name] = jnp.asarray(site["value"])
            entry["kwargs"] = (
                {"constraint": site["kwargs"].get("constraint")}
                if site["kwargs"].get("constraint") is not None
                else {}
            )
        elif site["type"] == "plate":
            entry["args"] = tuple(site["args"])
        out[name] = entry
    held = [entry["fn"].support for entry in out.values() if "fn" in entry] + [
        entry["kwargs"].get("constraint") for entry in out.values() if entry["type"] == "param"
    ]
    if any(
        isinstance(leaf, jax.core.Tracer)
        for c in held
        if c is not None
        for leaf in jax.tree.leaves(vars(c))
    ):
        out[_TRACED_SUPPORT] = True
    return out, params, blocks


def read_shapes(model: Callable, args: tuple, kwargs: dict, who: str) -> dict:
    """The model's static trace on these data, traced abstractly (``jax.eval_shape``: nothing
    computed)."""
    found: dict = {}
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, (np.ndarray, jax.Array))]

    def trace_once(*values: jax.Array) -> jax.Array:
        full = list(leaves)
        for i, value in zip(arrays, values):
            full[i] = value
        c_args, c_kwargs = jax.tree_util.tree_unflatten(treedef, full)
        found["trace"], _, _ = _static_trace(checked_trace(model, c_args, c_kwargs, who))
        return jnp.zeros(())

    jax.eval_shape(trace_once, *[leaves[i] for i in arrays])
    return found["trace"]
