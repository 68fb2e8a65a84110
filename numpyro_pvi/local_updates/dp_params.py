"""The parameters ``DPGradientUpdate`` optimises, and their reparameterised draws, for every family.

* :class:`GaussianParameters` (a Gaussian :class:`~numpyro_pvi.families.Family`): ``(loc, u)`` with
  ``scale = biject_to(scale_constraint)(u)``, draws ``zeta_s = loc + scale @ eps_s`` from fixed
  standard normals ``eps`` ``(S, D)``. The fast path: :mod:`~numpyro_pvi.local_updates.dp_clipping`
  has closed-form per-row norms for :class:`~numpyro_pvi.MeanFieldGaussian`.
* :class:`GuideParameters` (any other :class:`~numpyro_pvi.families.FactorFamily`:
  :class:`~numpyro_pvi.SiteFamilies`, :class:`~numpyro_pvi.Gamma`, ...): the unconstrained values of
  the ``numpyro.param`` sites the family's :meth:`~numpyro_pvi.families.FactorFamily.guide`
  registers (each site's constraint read once, by tracing the guide), in the pytree of its
  :meth:`~numpyro_pvi.families.FactorFamily.guide_params`; draws
  ``params_distribution(params).rsample(key_s)`` from fixed per-draw keys ``eps`` ``(S, 2)``
  (``jax.random.split(key, S)``). JAX's gamma sampler is implicitly reparameterised, so Gamma, Beta
  and Dirichlet draws are differentiable in their parameters.

Both give the same members, which is all ``DPGradientUpdate`` and the clipping use.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from numpyro_pvi.families import Family, NatParams
from numpyro_pvi.local_updates.base import ClientProblem

# the names of the guide's param sites (only used to call the family's guide methods)
PREFIX = "_pvi_dp_"


class GaussianParameters:
    """``(loc, u)`` of a Gaussian family: ``scale = biject_to(family.scale_constraint)(u)``.

    **Example:** ``GaussianParameters(pvi.MeanFieldGaussian()).init(q)`` is ``(loc, u)``.
    """

    def __init__(self, family: Family) -> None:
        self.family, self.constrain = family, biject_to(family.scale_constraint)

    def init(self, q: NatParams) -> tuple:
        """The parameters of ``q``."""
        loc, scale = self.family.loc_scale(q)
        return loc, self.constrain.inv(scale)

    def distribution(self, params: tuple) -> dist.Distribution:
        """The guide's distribution."""
        return self.family.distribution(params[0], self.constrain(params[1]))

    def cavity_distribution(self, cavity: NatParams) -> dist.Distribution:
        """The cavity as a distribution of the same kind (its KL to the guide is analytic)."""
        return self.family.distribution(*self.family.loc_scale(cavity))

    def nat(self, params: tuple) -> NatParams:
        """The natural parameters of the guide."""
        return self.family.from_loc_scale(params[0], self.constrain(params[1]))

    def noise(self, rng_key: jax.Array, num_draws: int, dim: int) -> jax.Array:
        """``eps``: ``(S, D)`` standard normals."""
        return jax.random.normal(rng_key, (num_draws, dim))

    def draws(self, eps: jax.Array) -> Callable:
        """``params -> zeta`` ``(S, D)``: ``loc + scale @ eps_s``."""
        family, constrain = self.family, self.constrain
        return lambda params: jax.vmap(
            lambda e: family.unwhiten(params[0], constrain(params[1]), e)
        )(eps)


def guide_constraints(family: Any, dim: int) -> tuple[Any, tuple, tuple]:
    """``(treedef, names, constraints)``: the guide's param sites in the order of ``guide_params``'
    leaves.

    The guide is traced once (shapes only, :func:`jax.eval_shape`); a leaf of ``guide_params`` is
    matched to the param site initialised with that very array. A guide that registers something
    else (a transformed initial value) is refused with ``NotImplementedError``.

    **Example:** ``guide_constraints(pvi.Gamma(), 1)[1:]`` is ``(("_pvi_dp_concentration",
    "_pvi_dp_rate"), (positive, positive))``.
    """
    found: list = []

    def trace() -> Any:
        params = family.guide_params(family.zeros(dim))
        leaves, treedef = jax.tree.flatten(params)
        sites = [
            s
            for s in handlers.trace(family.guide).get_trace(PREFIX, params).values()
            if s["type"] == "param"
        ]
        names = [next((s["name"] for s in sites if s["args"][0] is leaf), None) for leaf in leaves]
        if None in names or len(sites) != len(leaves):
            raise NotImplementedError(
                f"DPGradientUpdate: the guide of {family!r} does not register one param site per "
                "leaf of its guide_params (initialised at that leaf), which the DP "
                "parameterisation of a non-Gaussian family needs."
            )
        by_name = {s["name"]: s["kwargs"].get("constraint", constraints.real) for s in sites}
        found.append((treedef, tuple(names), tuple(by_name[n] for n in names)))
        return params

    jax.eval_shape(trace)
    return found[0]


class GuideParameters:
    """The unconstrained values of a family's guide sites, in the pytree of its ``guide_params``.

    **Example:** ``GuideParameters(pvi.Gamma(), 1).init(q)`` is ``(log shape, log rate)``.
    """

    def __init__(self, family: Any, dim: int) -> None:
        self.family = family
        self.treedef, self.names, constraints_ = guide_constraints(family, dim)
        self.transforms = tuple(biject_to(c) for c in constraints_)

    def init(self, q: NatParams) -> Any:
        """The parameters of ``q``."""
        leaves = self.treedef.flatten_up_to(self.family.guide_params(q))
        return self.treedef.unflatten([t.inv(x) for t, x in zip(self.transforms, leaves)])

    def constrained(self, params: Any) -> list:
        """The guide sites' constrained values, in leaf order."""
        return [t(x) for t, x in zip(self.transforms, self.treedef.flatten_up_to(params))]

    def distribution(self, params: Any) -> dist.Distribution:
        """The guide's distribution (``params_distribution``)."""
        return self.family.params_distribution(self.treedef.unflatten(self.constrained(params)))

    def cavity_distribution(self, cavity: NatParams) -> dist.Distribution:
        """The cavity (``to_dist``)."""
        return self.family.to_dist(cavity)

    def nat(self, params: Any) -> NatParams:
        """The natural parameters of the guide (``from_guide``)."""
        return self.family.from_guide(PREFIX, dict(zip(self.names, self.constrained(params))))

    def noise(self, rng_key: jax.Array, num_draws: int, dim: int) -> jax.Array:
        """``eps``: ``S`` keys, one per draw (shared by the rows)."""
        return jax.random.split(rng_key, num_draws)

    def draws(self, eps: jax.Array) -> Callable:
        """``params -> zeta`` ``(S, D)``: one reparameterised draw per key of ``eps``."""
        return lambda params: jax.vmap(lambda key: self.distribution(params).rsample(key))(eps)


def parameters_for(problem: ClientProblem) -> GaussianParameters | GuideParameters:
    """:class:`GaussianParameters` for a Gaussian family, :class:`GuideParameters` for any other.

    **Example:** ``zeta = parameters_for(problem).draws(eps)(params)``.
    """
    family = problem.family
    return (
        GaussianParameters(family)
        if isinstance(family, Family)
        else GuideParameters(family, problem.dim)
    )
