"""The parameters DP-SGD optimises for a family, and their reparameterised draws.

A family's :meth:`~numpyro_pvi.families.FactorFamily.reparameterised` returns one of these (the
``DPGradientUpdate`` of :mod:`numpyro_pvi.privacy.dp_sgd` uses nothing else of the
family):

* :class:`GaussianParameters` (both Gaussian families): ``(loc, u)`` with ``scale =
  biject_to(scale_constraint)(u)``, draws ``zeta_s = loc + scale @ eps_s`` from fixed standard
  normals ``eps`` ``(S, D)``. :class:`MeanFieldParameters` (``MeanFieldGaussian``) adds the
  closed-form per-row gradient norms.
* :class:`GuideParameters` (every other family: :class:`~numpyro_pvi.SiteFamilies`,
  :class:`~numpyro_pvi.Gamma`, ...): the unconstrained values of the ``numpyro.param`` sites the
  family's :meth:`~numpyro_pvi.families.FactorFamily.guide` registers (each site's constraint read
  once, by tracing the guide), in the pytree of its
  :meth:`~numpyro_pvi.families.FactorFamily.guide_params`; draws
  ``params_distribution(params).rsample(key_s)`` from fixed per-draw keys ``eps`` ``(S, 2)``
  (``jax.random.split(key, S)``). JAX's gamma sampler is implicitly reparameterised, so Gamma, Beta
  and Dirichlet draws are differentiable in their parameters.

All give the same members (:class:`Reparameterised`); :meth:`Reparameterised.row_squared_norms`
is the generic ``jax.vjp`` path, which a family may replace with a closed form.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to

from numpyro_pvi.families.params import NatParams

# the names of the guide's param sites (only used to call the family's guide methods)
PREFIX = "_pvi_dp_"


class Reparameterised:
    """What DP-SGD needs of a family: its parameters, their draws at fixed noise, the natural
    parameters back.

    Subclasses implement :meth:`init`, :meth:`distribution`, :meth:`cavity_distribution`,
    :meth:`nat`, :meth:`noise` and :meth:`draws`; :meth:`row_squared_norms` has a generic default.

    **Example:** ``zeta = pvi.MeanFieldGaussian().reparameterised(D).draws(eps)(params)``.
    """

    def init(self, q: NatParams) -> Any:
        """The parameters of ``q``."""
        raise NotImplementedError

    def distribution(self, params: Any) -> dist.Distribution:
        """The guide's distribution."""
        raise NotImplementedError

    def cavity_distribution(self, cavity: NatParams) -> dist.Distribution:
        """The cavity as a distribution its KL to :meth:`distribution` is defined for."""
        raise NotImplementedError

    def nat(self, params: Any) -> NatParams:
        """The natural parameters of the guide."""
        raise NotImplementedError

    def noise(self, rng_key: jax.Array, num_draws: int, dim: int) -> jax.Array:
        """``eps``: the fixed randomness of ``num_draws`` draws."""
        raise NotImplementedError

    def draws(self, eps: jax.Array) -> Callable:
        """``params -> zeta`` ``(S, D)``: the guide's draws at the fixed randomness ``eps``."""
        raise NotImplementedError

    def row_squared_norms(
        self, params: Any, eps: jax.Array, grads: list, cuts: list[int]
    ) -> jax.Array:
        """``(rows,)``: ``||J^T g_i||^2``, each row's squared gradient norm in ``params``.

        ``J`` is the Jacobian of ``params -> zeta`` (:meth:`draws` at ``eps``, ``S`` draws), and
        ``g_i`` the row's gradients in ``zeta`` divided by ``S``: ``grads[s][k]`` ``(rows,
        size_k)`` is ``grad log p(y_i | zeta_s)`` in the block of global site ``k`` (blocks split
        at ``cuts``). The default applies ``J^T`` to every row's ``(S, D)`` gradients by
        ``jax.vjp``.

        **Example:** ``reparameterised.row_squared_norms(params, eps, grads, [])`` is ``(rows,)``.
        """
        num_draws = eps.shape[0]
        _, pullback = jax.vjp(self.draws(eps), params)
        stacked = (
            jnp.stack([jnp.concatenate(blocks, axis=-1) for blocks in grads], axis=1) / num_draws
        )
        per_row = jax.vmap(lambda g: pullback(g)[0])(stacked)
        return sum(
            jnp.sum(leaf.reshape(leaf.shape[0], -1) ** 2, axis=1)
            for leaf in jax.tree.leaves(per_row)
        )


class GaussianParameters(Reparameterised):
    """``(loc, u)`` of a Gaussian family: ``scale = biject_to(family.scale_constraint)(u)``.

    **Example:** ``pvi.FullRankGaussian().reparameterised(D).init(q)`` is ``(loc, u)``.
    """

    def __init__(self, family: Any) -> None:
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


class MeanFieldParameters(GaussianParameters):
    """:class:`GaussianParameters` of ``MeanFieldGaussian``, with the per-row norms in closed form.

    **Example:** ``pvi.MeanFieldGaussian().reparameterised(D)`` is one.
    """

    def row_squared_norms(
        self, params: tuple, eps: jax.Array, grads: list, cuts: list[int]
    ) -> jax.Array:
        """``(rows,)``: ``||J^T g_i||^2`` in closed form (``J`` is diagonal per draw).

        loc's gradient is ``a_i = sum_s g_is / S`` and ``u``'s ``b_i * dscale/du`` with ``b_i =
        sum_s g_is eps_s / S``, so ``||a_i||^2 + ||b_i dscale||^2 = sum_{s,t} (g_is * g_it) @ (1 +
        eps_s eps_t dscale^2) / S^2``: one matrix-vector product per pair of draws (one in all for a
        single draw), block by block.
        """
        num_draws = eps.shape[0]
        # elementwise d scale / d u
        _, dscale = jax.jvp(self.constrain, (params[1],), (jnp.ones_like(params[1]),))
        eps_blocks = [jnp.split(e, cuts) for e in eps]
        total = 0.0
        for k, d in enumerate(jnp.split(dscale, cuts)):  # sum over pairs of draws s <= t
            for s in range(num_draws):
                for t in range(s, num_draws):
                    weight = (1.0 + eps_blocks[s][k] * eps_blocks[t][k] * d * d) * (
                        (1.0 if s == t else 2.0) / num_draws**2
                    )
                    total = total + (grads[s][k] * grads[t][k]) @ weight
        return total


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


class GuideParameters(Reparameterised):
    """The unconstrained values of a family's guide sites, in the pytree of its ``guide_params``.

    **Example:** ``pvi.Gamma().reparameterised(1).init(q)`` is ``(log shape, log rate)``.
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
