"""The contract of every family of factors: :class:`FactorFamily` (the Gaussian :class:`Family`
extends it)."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax
import numpyro.distributions as dist

from numpyro_pvi.families.mean_params import MeanParamFamily
from numpyro_pvi.families.params import Marginals, NatParams, Proposal
from numpyro_pvi.families.reparameterised import Reparameterised


@runtime_checkable
class FactorFamily(Protocol):
    """What every family of factors implements: what PVI, the servers, the merge and
    ``GradientUpdate`` use.

    :class:`Family` (the Gaussian families) extends it with Gaussian algebra (whitening, forms,
    sites) that EP, SNEP and the Gaussian CVI path need. The exponential families in a site's own
    space (:class:`~numpyro_pvi.Gamma`, :class:`~numpyro_pvi.Beta`, :class:`~numpyro_pvi.Dirichlet`)
    and :class:`~numpyro_pvi.SiteFamilies` implement this contract and the mean-parameter contract
    :class:`~numpyro_pvi.families.MeanParamFamily` (SNEP's), as the Gaussian families do.

    * **Core**: :meth:`zeros`, :meth:`is_valid`, :meth:`to_dist`, :meth:`marginals`,
      :meth:`lay_out`.
    * **Mean parameters** (SNEP, EP's ``NUTSMoments``): :meth:`mean_param_family`, the family as a
      :class:`~numpyro_pvi.families.MeanParamFamily` or ``None``.
    * **Guide** (``GradientUpdate``, ``DPGradientUpdate``): :meth:`guide_params`,
      :meth:`params_distribution`,
      :meth:`guide`, :meth:`from_guide`.
    * **Natural-gradient site** (CVI): :meth:`draw`, :meth:`site_from_draws`.
    * **Laplace site** (CVI's fallback): :meth:`laplace_start`, :meth:`laplace_log_density`,
      :meth:`laplace_precision`, :meth:`from_laplace` (the family's unconstrained coordinates ``x``,
      ``(D,)``: ``zeta`` for a Gaussian, ``log theta`` for a ``Gamma``, ``logit theta`` for a
      ``Beta``).
    * **Moment matching** (EP): :meth:`match_moments` (trusted from :meth:`min_effective_draws`
      effective draws on), and the importance proposal at the Laplace
      approximation, :meth:`laplace_proposal` (a Gaussian's: the dense ``N(mode, P^-1)``, whose
      correlations a mean-field member would drop; the others': :func:`member_proposal` of
      :meth:`from_laplace`).
    * **Start and prior** (PVI's chosen start, the exact prior ``lambda_0`` and the prior factor
      ``t_0``):
      :meth:`initial_q`, :meth:`reference_draws`, :meth:`exact_prior`, :meth:`standard_normal`,
      :meth:`draws_at`, :meth:`prior_site`. A family that cannot hold a prior factor (the
      exponential families) raises ``ValueError`` from :meth:`standard_normal` and
      :meth:`prior_site` when asked for one.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.families import FactorFamily
        >>> isinstance(pvi.Gamma(), FactorFamily), isinstance(pvi.MeanFieldGaussian(), FactorFamily)
        (True, True)
    """

    def zeros(self, dim: int) -> NatParams:
        """The flat factor ``t = 1``."""
        ...

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite member of the family."""
        ...

    def to_dist(self, nat: NatParams) -> dist.Distribution:
        """``q`` as a NumPyro distribution over the flat vector ``zeta``."""
        ...

    def marginals(self, nat: Any) -> Marginals:
        """Per-coordinate means, variances (NaN where improper) and a precision-like diagonal,
        float64 numpy."""
        ...

    def lay_out(self, sites: Any) -> tuple[FactorFamily, Any]:
        """``(family, sites)``: this family laid out for the model's ``sites`` and the sites as it
        lays them out (sites in their own space get an identity transform).

        A pure function: the laid-out family is a new one (or this one if it needs no layout), and
        this one is never changed, so one family configures any number of problems; the problem
        holds the laid-out family (``problem.family``). Called once per problem; raises
        ``ValueError`` if a site does not fit the family.
        """
        ...

    def mean_param_family(self) -> MeanParamFamily | None:
        """This family as a :class:`~numpyro_pvi.families.MeanParamFamily` (sufficient statistics,
        mean parameters, chain coordinates: what SNEP and EP's ``NUTSMoments`` need), or ``None`` if
        it has none. Every built-in family has them (a ``SiteFamilies`` when all its blocks do).

        >>> import numpyro_pvi as pvi
        >>> family = pvi.Gamma()
        >>> family.mean_param_family() is family
        True
        """
        ...

    def guide_params(self, nat: NatParams) -> Any:
        """The guide's (constrained) parameters of valid ``nat``: a pytree."""
        ...

    def params_distribution(self, params: Any) -> dist.Distribution:
        """The distribution over ``zeta`` with guide parameters ``params``."""
        ...

    def guide(self, prefix: str, params: Any) -> dist.Distribution:
        """Register ``numpyro.param`` sites named ``prefix...`` initialised at ``params``; their
        distribution."""
        ...

    def from_guide(self, prefix: str, values: dict) -> NatParams:
        """Natural parameters from the constrained values of the sites :meth:`guide` registered."""
        ...

    def draw(self, nat: NatParams, rng_key: jax.Array, pairs: int) -> jax.Array:
        """``2 * pairs`` draws ``(2 pairs, D)`` of valid ``nat`` (antithetic where the family
        allows)."""
        ...

    def site_from_draws(
        self,
        nat: NatParams,
        zeta: jax.Array,
        values: jax.Array,
        grads: jax.Array,
        hessians: jax.Array | None,
    ) -> NatParams:
        """``grad_mu E_q[f]`` (natural parameters) from draws ``zeta`` of ``q``, ``f``'s values
        ``(S,)``, its gradients ``(S, D)`` and, if computed, Hessians ``(S, D, D)``."""
        ...

    def laplace_start(self, nat: NatParams) -> jax.Array:
        """The mode ``(D,)`` of valid ``nat`` in the Laplace coordinates ``x`` (where Newton
        starts)."""
        ...

    def laplace_log_density(self, nat: NatParams, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(zeta, log density)``: the point ``zeta`` at coordinates ``x`` ``(D,)`` and the log
        density of the valid ``nat`` in ``x`` (Jacobian included), up to a constant."""
        ...

    def laplace_precision(self, nat: NatParams) -> jax.Array:
        """The ``(D, D)`` negative Hessian of :meth:`laplace_log_density` of valid ``nat`` at its
        mode."""
        ...

    def from_laplace(self, mode: jax.Array, precision: jax.Array) -> NatParams:
        """The member whose mode is ``mode`` and whose negative Hessian there is ``precision`` ``(D,
        D)`` in the Laplace coordinates (or the nearest the family holds: a block's diagonal for an
        elementwise family)."""
        ...

    def match_moments(self, proposal: NatParams, zeta: jax.Array, weights: jax.Array) -> NatParams:
        """The member whose sufficient statistics' means match the weighted draws ``zeta`` ``(S,
        D)`` of ``proposal`` (self-normalised ``weights`` ``(S,)``), with ``proposal``'s exact
        moments as control variate: uniform weights give ``proposal`` itself (EP is exact when the
        tilted distribution is in the family)."""
        ...

    def laplace_proposal(
        self, mode: jax.Array, precision: jax.Array, rng_key: jax.Array, pairs: int
    ) -> Proposal:
        """``2 pairs`` importance draws near the Laplace approximation ``(mode, precision)`` (in the
        Laplace coordinates), with :meth:`from_laplace` as the member: EP's proposal."""
        ...

    def min_effective_draws(self) -> int:
        """The fewest effective importance draws whose weighted statistics :meth:`match_moments`
        turns into a usable member (EP takes no step below it): 0 for a Gaussian (its
        control-variate covariance stays near the proposal's, and an invalid one is halved), 10 for
        an exponential family (its member matched to a few draws is a point mass: a Gamma block went
        from shape 179 to ``9e9`` in one step, from 2 effective draws of 1,024)."""
        ...

    def initial_q(self, loc: jax.Array, scale: float) -> NatParams:
        """The chosen start: the member with mean ``loc`` (``(D,)``, the block's coordinates) and
        spread ``scale`` (``ValueError`` if the family cannot take it); see
        :mod:`numpyro_pvi.model.start` for each family's meaning."""
        ...

    def reference_draws(self, dim: int) -> jax.Array:
        """``(S, dim)`` fixed points in the family's space at which a prior is read off."""
        ...

    def exact_prior(self, sites: Any, prior_values: Callable) -> tuple[NatParams, tuple]:
        """``(lambda_0, rest)``: the prior over the sites the family holds exactly, and the names of
        the others (fitted by the prior factor ``t_0``); ``ValueError`` if a site's prior can be
        neither.

        :param sites: the sites (as :meth:`lay_out` laid them out) of this family's
            coordinates.
        :param prior_values: ``names -> (values (S,), points (S, D))``, the prior's log density of
            the sites ``names`` at :meth:`reference_draws` points.
        """
        ...

    def standard_normal(self, mask: Any) -> NatParams:
        """``N(0, 1)`` where the ``(D,)`` boolean ``mask`` is true, flat elsewhere (where ``t_0``
        starts)."""
        ...

    def draws_at(self, nat: NatParams, eps: jax.Array) -> jax.Array:
        """Draws ``(S, D)`` of valid ``nat`` that are a deterministic function of ``nat`` and the
        fixed standard-normal points ``eps`` ``(S, D)``."""
        ...

    def prior_site(
        self, q: NatParams, eps: jax.Array, log_density: Callable, mask: Any, use_hessian: bool
    ) -> NatParams:
        """``grad_mu E_q[log_density(zeta)]`` at :meth:`draws_at` points: the prior factor ``t_0``'s
        target.

        :param mask: ``(D,)`` boolean, the coordinates ``log_density`` depends on (the sites ``t_0``
            fits).
        :param use_hessian: whether to use Hessians (else Stein's lemma from gradients).
        """
        ...

    # ------------------------------------------------------------------ DP-SGD and the wire
    def reparameterised(self, dim: int) -> Reparameterised:
        """The parameters ``DPGradientUpdate`` optimises, their draws at fixed noise and each data
        row's gradient norm in them (:mod:`~numpyro_pvi.families.reparameterised`): ``(loc, u)``
        for a Gaussian, the guide's unconstrained sites for the others."""
        ...

    def layout(self) -> Any:
        """What another instance needs, beyond the global sites' shapes, to lay itself out as this
        one was by :meth:`lay_out`: a JSON-able value (``None`` if nothing)."""
        ...

    def with_layout(self, layout: Any, shapes: dict) -> FactorFamily:
        """The family laid out as :meth:`layout` (``layout``) and the global sites' ``shapes`` (site
        name -> shape) describe, without the model: a new family (or this one if it needs no
        layout), never this one changed; ``ValueError`` if it cannot be."""
        ...


def member_proposal(
    family: FactorFamily, member: NatParams, rng_key: jax.Array, pairs: int
) -> Proposal:
    """The valid ``member`` as an importance proposal: its ``2 pairs`` draws (``family.draw``) and
    their log density.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.families.factor import member_proposal
        >>> family = pvi.Gamma()
        >>> proposal = member_proposal(
        ...     family, family.from_params(jnp.ones(1), jnp.ones(1)), jax.random.PRNGKey(0), 8
        ... )
        >>> proposal.draws.shape, proposal.log_density.shape
        ((16, 1), (16,))
    """
    draws = family.draw(member, rng_key, pairs)
    return Proposal(member, draws, family.to_dist(member).log_prob(draws))
