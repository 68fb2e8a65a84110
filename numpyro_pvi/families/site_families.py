"""``SiteFamilies``: a family per global site (or group of sites); ``q`` is block-diagonal across
the groups.

The flat vector ``zeta`` is laid out block by block (the blocks in the order their first site
appears in the model, each block's sites in model order). A block's coordinates are its sites'
unconstrained values for a Gaussian family and their constrained values for an exponential family in
the site's own space (:mod:`numpyro_pvi.families.exponential`). Natural parameters are one
:class:`NatParams` whose ``eta1`` is the flat ``(D,)`` concatenation of the blocks' ``eta1`` and
whose ``eta2`` is the tuple of the blocks' ``eta2``: they add and scale like every family's, so the
merge, cavities, damping and checkpoints are unchanged. Every other member maps over the blocks.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist

from numpyro_pvi.families import tilted
from numpyro_pvi.families.block_distribution import BlockDistribution
from numpyro_pvi.families.chain_moments import MeanParamChains, refuse_site_clamp
from numpyro_pvi.families.factor import FactorFamily, member_proposal
from numpyro_pvi.families.mean_field import MeanFieldGaussian
from numpyro_pvi.families.params import Marginals, NatParams, Proposal
from numpyro_pvi.families.reparameterised import GuideParameters


class SiteFamilies:
    """A factor family per global site or group of sites, ``default`` for the rest (one block of
    them).

    A client's factor is the product of its per-block factors, so ``q`` is block-diagonal across the
    blocks: e.g. ``FullRankGaussian`` over regression weights, a ``Gamma`` over a noise precision
    and mean field elsewhere. A key is a site name or a tuple of site names (one block holding them
    all). The layout is read from the model when :class:`~numpyro_pvi.PVI` builds its problem,
    which holds a laid-out copy (``problem.family``, ``result.family``; :meth:`lay_out`); the
    instance itself is never changed, so one may configure any number of models.

    A Gaussian block holds its Gaussian priors (``Normal``, ``LogNormal``, ``MultivariateNormal``
    with fixed parameters) exactly and fits the others (a ``HalfNormal`` scale...) by its part of
    the prior factor ``t_0``, as a plain Gaussian family does; an exponential-family block's prior
    must be of the family itself (``Gamma``, ``Beta``, ``Dirichlet``: ``ValueError`` otherwise).
    ``GradientUpdate``, ``NaturalGradientUpdate``, ``MomentMatchingUpdate``, ``SNEPUpdate`` (in mean
    parameters, through
    :class:`~numpyro_pvi.families.MeanParamFamily`), ``DPGradientUpdate`` and ``DPLocalAveraging``
    (of an update that supports it) support it.

    :param families: site name (or tuple of names) -> family.
    :param default: the family of every other global site (one block); default
        ``MeanFieldGaussian()``.

    **Example:** ``pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})``

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
        SiteFamilies({'w': FullRankGaussian(), 'tau': Gamma()}, default=MeanFieldGaussian())
    """

    def __init__(self, families: dict, default: FactorFamily | None = None) -> None:
        if not isinstance(families, dict) or not families:
            raise TypeError(
                f"SiteFamilies: families must be a non-empty dict site -> family, got {families!r}."
            )
        default = MeanFieldGaussian() if default is None else default
        self.groups: dict = {}
        for key, family in families.items():
            names = (key,) if isinstance(key, str) else tuple(key)
            if not names or not all(isinstance(n, str) for n in names):
                raise TypeError(
                    f"SiteFamilies: a key must be a site name or a tuple of names, got {key!r}."
                )
            for family_ in (family, default):
                if isinstance(family_, SiteFamilies) or not isinstance(family_, FactorFamily):
                    raise TypeError(
                        f"SiteFamilies: {family_!r} is not a family (pvi.MeanFieldGaussian(), "
                        "pvi.FullRankGaussian(), pvi.Gamma(), pvi.Beta(), pvi.Dirichlet())."
                    )
            self.groups[names] = family
        taken = [n for names in self.groups for n in names]
        if len(set(taken)) != len(taken):
            raise ValueError(f"SiteFamilies: a site is named in two groups: {taken}.")
        self.families, self.default = dict(families), default
        self.blocks: tuple | None = None  # ((family, start, stop, names), ...) once laid out

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {family_name(f)}" for k, f in self.families.items())
        return f"SiteFamilies({{{inner}}}, default={family_name(self.default)})"

    # ------------------------------------------------------------------ layout
    def lay_out(self, sites: Any) -> tuple[SiteFamilies, Any]:
        """``(family, sites)``: a copy laid out block by block for the model's ``sites`` (each
        block's family laid out for its sites), and the sites as the blocks lay them out. This
        instance is left as it was (unlaid), so one ``SiteFamilies`` configures any number of
        problems; the problem holds the copy (``problem.family``).

        **Example:** ``family, sites = pvi.SiteFamilies({"tau": pvi.Gamma()}).lay_out(sites)``.
        """
        names = [s.name for s in sites.globals]
        unknown = [n for group in self.groups for n in group if n not in names]
        if unknown:
            raise ValueError(
                f"SiteFamilies names {unknown}, which are not global latent sites of the model "
                f"(its global sites: {names})."
            )
        order, members = [], {}
        for site in sites.globals:
            group = self._group_of(site.name)
            if group not in members:
                order.append(group)
                members[group] = []
            members[group].append(site)
        globals_, gaussian, blocks, start = [], dict(sites.gaussian_prior), [], 0
        for group in order:
            family, sub = self._family_of(group).lay_out(
                replace(sites, globals=tuple(members[group]))
            )
            for site in members[group]:
                gaussian.pop(site.name, None)
            gaussian.update(sub.gaussian_prior)
            size = sum(s.size for s in sub.globals)
            blocks.append((family, start, start + size, tuple(s.name for s in sub.globals)))
            globals_.extend(sub.globals)
            start += size
        laid_out = replace(sites, globals=tuple(globals_), gaussian_prior=gaussian)
        return self._with_blocks(tuple(blocks)), laid_out

    def layout(self) -> tuple:
        """The laid-out blocks as ``((names, size), ...)``: what :meth:`with_layout` needs to lay
        out another instance with the same groups identically, without the model (e.g. a Flower
        server, which has no data).

        **Example:** ``SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})`` laid out
        for a model with ``w`` of shape ``(2,)`` and ``tau`` has the layout ``((("w",), 2),
        (("tau",), 1))``.
        """
        return tuple((names, b - a) for _, a, b, names in self._laid_out())

    def with_layout(self, layout: Iterable, shapes: dict) -> SiteFamilies:
        """A copy laid out as :meth:`layout` described another instance with the same groups (this
        one is left as it was): what a Flower server, which has no data, does with a site's layout.

        :param layout: ``((names, size), ...)`` per block, as :meth:`layout` gives it.
        :param shapes: site name -> the site's shape (a ``Dirichlet`` block records its site's
            shape).
        :raises ValueError: if a block's sites are not one group of this instance.

        **Example:** ``family.with_layout(((("w",), 2), (("tau",), 1)), {"w": (2,), "tau": ()})``.
        """
        if layout is None:
            raise ValueError(
                f"{self!r} is laid out from the model's sites, not from their shapes alone: use "
                "the problem's laid-out copy (problem.family; inference.get_posterior(state, "
                "problem); result.get_posterior()) or give its layout (problem.family.layout())."
            )
        blocks, start = [], 0
        for names, size in layout:
            names = tuple(names)
            groups = {self._group_of(n) for n in names}
            if len(groups) != 1 or any(n not in shapes for n in names):
                raise ValueError(
                    f"SiteFamilies: the block {names} of the layout is not one group of {self!r} "
                    "(were both ends configured with the same SiteFamilies?)."
                )
            family = self._family_of(groups.pop()).with_layout(
                None, {n: tuple(shapes[n]) for n in names}
            )
            blocks.append((family, start, start + int(size), names))
            start += int(size)
        return self._with_blocks(tuple(blocks))

    def _with_blocks(self, blocks: tuple) -> SiteFamilies:
        """A copy of this (unlaid) instance with these blocks; this one is left as it was."""
        laid_out = copy.copy(self)
        laid_out.blocks = blocks
        return laid_out

    def _group_of(self, name: str) -> tuple | None:
        """The group naming site ``name`` (``None``: the default block's)."""
        return next((g for g in self.groups if name in g), None)

    def _family_of(self, group: tuple | None) -> FactorFamily:
        return self.default if group is None else self.groups[group]

    def _laid_out(self) -> tuple:
        if self.blocks is None:
            raise RuntimeError(
                f"{self!r} is not laid out: it is laid out from the model's sites, and the problem "
                "holds the laid-out copy (problem.family, result.family): build the problem first "
                "(inference.build(...), init or run) and use its family."
            )
        return self.blocks

    def split(self, nat: NatParams) -> list:
        """The blocks' natural parameters (leading batch axes kept)."""
        return [
            NatParams(nat.eta1[..., a:b], eta2)
            for (_, a, b, _), eta2 in zip(self._laid_out(), nat.eta2)
        ]

    def join(self, parts: list) -> NatParams:
        """Natural parameters from the blocks'."""
        return NatParams(
            jnp.concatenate([p.eta1 for p in parts], axis=-1), tuple(p.eta2 for p in parts)
        )

    def _map(self, method: str, *trees: Any) -> list:
        return [getattr(block[0], method)(*args) for block, *args in zip(self._laid_out(), *trees)]

    # ------------------------------------------------------------------ core
    def zeros(self, dim: int) -> NatParams:
        """The flat factor: every block's."""
        blocks = self._laid_out()
        if dim != blocks[-1][2]:
            raise ValueError(
                f"SiteFamilies is laid out for {blocks[-1][2]} coordinates, got {dim}."
            )
        return self.join([family.zeros(b - a) for family, a, b, _ in blocks])

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether every block is valid."""
        return jnp.all(jnp.stack(self._map("is_valid", self.split(nat))))

    def to_dist(self, nat: NatParams) -> dist.Distribution:
        """The product of the blocks' distributions, over the flat vector."""
        return BlockDistribution(self._map("to_dist", self.split(nat)))

    def marginals(self, nat: Any) -> Marginals:
        """The blocks' marginals, concatenated."""
        blocks = self._laid_out()
        eta1 = np.asarray(nat.eta1)
        parts = [
            family.marginals(NatParams(eta1[..., a:b], np.asarray(eta2)))
            for (family, a, b, _), eta2 in zip(blocks, nat.eta2)
        ]
        return Marginals(*(np.concatenate(x) for x in zip(*parts)))

    # ------------------------------------------------------------------ guide
    def guide_params(self, nat: NatParams) -> tuple:
        """The blocks' guide parameters."""
        return tuple(self._map("guide_params", self.split(nat)))

    def params_distribution(self, params: tuple) -> dist.Distribution:
        """The product of the blocks' distributions with these parameters."""
        return BlockDistribution(self._map("params_distribution", params))

    def guide(self, prefix: str, params: tuple) -> dist.Distribution:
        """Each block's ``numpyro.param`` sites, prefixed ``prefix + "<block>_"``."""
        prefixes = [f"{prefix}{i}_" for i in range(len(self._laid_out()))]
        return BlockDistribution(self._map("guide", prefixes, params))

    def from_guide(self, prefix: str, values: dict) -> NatParams:
        """From the blocks' guide parameters."""
        prefixes = [f"{prefix}{i}_" for i in range(len(self._laid_out()))]
        return self.join(self._map("from_guide", prefixes, [values] * len(prefixes)))

    # ------------------------------------------------------------------ GradientUpdate's guide
    # against the cavity
    def tilted_params(self, cavity: NatParams, q: NatParams) -> tuple[tuple, tuple]:
        """Each block's ``(cavity_params, guide_params)``
        (:func:`~numpyro_pvi.families.tilted.tilted_params`)."""
        pairs = [
            tilted.tilted_params(block[0], c, b)
            for block, c, b in zip(self._laid_out(), self.split(cavity), self.split(q))
        ]
        return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)

    def cavity_distribution(self, cavity_params: tuple) -> dist.Distribution:
        """The product of the blocks' cavities."""
        return BlockDistribution(
            [
                tilted.cavity_distribution(block[0], p)
                for block, p in zip(self._laid_out(), cavity_params)
            ]
        )

    def cavity_guide(self, prefix: str, cavity_params: tuple, params: tuple) -> dist.Distribution:
        """Each block's guide against its cavity, its sites prefixed ``prefix + "<block>_"``."""
        return BlockDistribution(
            [
                tilted.client_guide(block[0], f"{prefix}{i}_", c, p)
                for i, (block, c, p) in enumerate(zip(self._laid_out(), cavity_params, params))
            ]
        )

    def from_cavity_guide(self, prefix: str, cavity_params: tuple, values: dict) -> NatParams:
        """From the blocks' guide parameters."""
        return self.join(
            [
                tilted.from_client_guide(block[0], f"{prefix}{i}_", c, values)
                for i, (block, c) in enumerate(zip(self._laid_out(), cavity_params))
            ]
        )

    # ------------------------------------------------------------------ natural-gradient site
    def draw(self, nat: NatParams, rng_key: jax.Array, pairs: int) -> jax.Array:
        """The blocks' draws (independent keys), concatenated: ``(2 pairs, D)``."""
        keys = list(jax.random.split(rng_key, len(self._laid_out())))
        return jnp.concatenate(
            self._map("draw", self.split(nat), keys, [pairs] * len(keys)), axis=-1
        )

    def site_from_draws(
        self,
        nat: NatParams,
        zeta: jax.Array,
        values: jax.Array,
        grads: jax.Array,
        hessians: jax.Array | None,
    ) -> NatParams:
        """Each block's site from the joint draws (its slice of ``zeta``, the gradients and the
        Hessians)."""
        parts = []
        for (family, a, b, _), part in zip(self._laid_out(), self.split(nat)):
            hess = None if hessians is None else hessians[:, a:b, a:b]
            parts.append(family.site_from_draws(part, zeta[:, a:b], values, grads[:, a:b], hess))
        return self.join(parts)

    # ------------------------------------------------------------------ Laplace site (CVI's
    # fallback)
    def laplace_start(self, nat: NatParams) -> jax.Array:
        """The blocks' modes in their Laplace coordinates, concatenated."""
        return jnp.concatenate(self._map("laplace_start", self.split(nat)), axis=-1)

    def laplace_log_density(self, nat: NatParams, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The blocks' points (concatenated) and the sum of their log densities, each at its slice
        of ``x``."""
        parts = [
            family.laplace_log_density(part, x[a:b])
            for (family, a, b, _), part in zip(self._laid_out(), self.split(nat))
        ]
        return jnp.concatenate([p[0] for p in parts]), sum(p[1] for p in parts)

    def laplace_precision(self, nat: NatParams) -> jax.Array:
        """Block-diagonal: each block's precision in its Laplace coordinates."""
        blocks = self._laid_out()
        precision = jnp.zeros((blocks[-1][2], blocks[-1][2]), nat.eta1.dtype)
        for (family, a, b, _), part in zip(blocks, self.split(nat)):
            precision = precision.at[a:b, a:b].set(family.laplace_precision(part))
        return precision

    def from_laplace(self, mode: jax.Array, precision: jax.Array) -> NatParams:
        """Each block's member from the joint mode's slice and its diagonal block of the joint
        precision (the conditional precision of the block given the others at the mode: a Gaussian
        block is ``N(mode, P_block^-1)``)."""
        return self.join(
            [
                family.from_laplace(mode[a:b], precision[a:b, a:b])
                for family, a, b, _ in self._laid_out()
            ]
        )

    def laplace_proposal(
        self, mode: jax.Array, precision: jax.Array, rng_key: jax.Array, pairs: int
    ) -> Proposal:
        """Draws of the member :meth:`from_laplace`
        (:func:`~numpyro_pvi.families.factor.member_proposal`)."""
        return member_proposal(self, self.from_laplace(mode, precision), rng_key, pairs)

    def min_effective_draws(self) -> int:
        """The largest of the blocks' (the weights are shared by every block)."""
        return max(family.min_effective_draws() for family, _, _, _ in self._laid_out())

    def match_moments(self, proposal: NatParams, zeta: jax.Array, weights: jax.Array) -> NatParams:
        """Each block matched to its marginal weighted moments."""
        return self.join(
            [
                family.match_moments(part, zeta[:, a:b], weights)
                for (family, a, b, _), part in zip(self._laid_out(), self.split(proposal))
            ]
        )

    # ------------------------------------------------------------------ mean parameters (SNEP;
    # MeanParamFamily)
    def _mean_param_blocks(self) -> tuple:
        """The blocks, each a ``MeanParamFamily`` (``TypeError`` if one is not)."""
        blocks = self._laid_out()
        for family, _, _, names in blocks:
            if family.mean_param_family() is None:
                raise TypeError(
                    f"SiteFamilies: the block {list(names)}'s family {family!r} has no mean "
                    "parameters (numpyro_pvi.families.MeanParamFamily), which SNEPUpdate needs."
                )
        return blocks

    def mean_param_family(self) -> SiteFamilies | None:
        """This family if every block's family has mean parameters, else ``None``."""
        families = [*self.groups.values(), self.default]
        return self if all(f.mean_param_family() is not None for f in families) else None

    def chain_moments(self, control_variates: bool, site_variance: tuple | None) -> MeanParamChains:
        """Stein features regressed under ``q`` over all the blocks together
        (:class:`~numpyro_pvi.families.chain_moments.MeanParamChains`); ``site_variance`` is a
        ``ValueError``."""
        refuse_site_clamp(self, site_variance)
        return MeanParamChains(self, control_variates)

    def log_factor(self, nat: NatParams, zeta: jax.Array) -> jax.Array:
        """The sum of the blocks' ``eta . T`` at their slices of ``zeta`` ``(D,)``."""
        return sum(
            family.log_factor(part, zeta[a:b])
            for (family, a, b, _), part in zip(self._mean_param_blocks(), self.split(nat))
        )

    def mean_params(self, nat: NatParams) -> NatParams:
        """The blocks' mean parameters."""
        return self.join(
            [
                block[0].mean_params(part)
                for block, part in zip(self._mean_param_blocks(), self.split(nat))
            ]
        )

    def chain_mean_params(self, zeta: jax.Array) -> NatParams:
        """The blocks' averages of ``T`` over the rows of ``zeta`` ``(C, D)``."""
        return self.join(
            [
                family.chain_mean_params(zeta[:, a:b])
                for family, a, b, _ in self._mean_param_blocks()
            ]
        )

    def from_mean_params(self, mean: NatParams, start: NatParams) -> NatParams:
        """Each block's member with its mean parameters."""
        return self.join(
            [
                block[0].from_mean_params(m, s)
                for block, m, s in zip(
                    self._mean_param_blocks(), self.split(mean), self.split(start)
                )
            ]
        )

    def chain_dim(self, dim: int) -> int:
        """The sum of the blocks' chain coordinates."""
        return sum(family.chain_dim(b - a) for family, a, b, _ in self._mean_param_blocks())

    def chain_frame(self, nat: NatParams) -> tuple:
        """The blocks' frames."""
        return tuple(
            block[0].chain_frame(part)
            for block, part in zip(self._mean_param_blocks(), self.split(nat))
        )

    def from_chain(self, frame: tuple, u: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each block's values from its slice of ``u``, concatenated; the sum of the log
        Jacobians."""
        values, log_det, start = [], jnp.zeros((), u.dtype), 0
        for (family, a, b, _), part in zip(self._mean_param_blocks(), frame):
            size = family.chain_dim(b - a)
            theta, block_log_det = family.from_chain(part, u[start : start + size])
            values.append(theta)
            log_det, start = log_det + block_log_det, start + size
        return jnp.concatenate(values), log_det

    def to_chain(self, frame: tuple, zeta: jax.Array) -> jax.Array:
        """Each block's chain coordinates of its slice of ``zeta`` ``(D,)``, concatenated."""
        return jnp.concatenate(
            [
                family.to_chain(part, zeta[a:b])
                for (family, a, b, _), part in zip(self._mean_param_blocks(), frame)
            ]
        )

    # ------------------------------------------------------------------ start and prior
    def initial_q(self, loc: jax.Array, scale: float) -> NatParams:
        """Each block's chosen start (its family's :meth:`initial_q` at its slice of ``loc``)."""
        return self.join(
            [family.initial_q(loc[a:b], scale) for family, a, b, _ in self._laid_out()]
        )

    def reference_draws(self, dim: int) -> jax.Array:
        """The blocks' reference points, concatenated: ``(S, D)``."""
        return jnp.concatenate(
            [family.reference_draws(b - a) for family, a, b, _ in self._laid_out()], axis=1
        )

    def exact_prior(self, sites: Any, prior_values: Callable) -> tuple[NatParams, tuple]:
        """Each block's exact prior; the sites no block holds exactly (a Gaussian block's
        non-Gaussian priors) are returned for the prior factor ``t_0``. ``prior_values(names) ->
        (values, points)`` as
        :meth:`ExponentialFamily.exact_prior <numpyro_pvi.families.ExponentialFamily.exact_prior>`
        (``points`` over every block; each block gets its slice)."""
        parts, rest = [], []
        for family, a, b, names in self._laid_out():
            sub = replace(sites, globals=tuple(s for s in sites.globals if s.name in names))

            def block_values(names_: tuple, a: int = a, b: int = b) -> tuple:
                values, points = prior_values(names_)
                return values, points[:, a:b]

            part, block_rest = family.exact_prior(sub, block_values)
            parts.append(part)
            rest.extend(block_rest)
        return self.join(parts), tuple(rest)

    def standard_normal(self, mask: Any) -> NatParams:
        """Each block's :meth:`standard_normal` of its slice of ``mask``."""
        mask = np.asarray(mask)
        return self.join(
            [family.standard_normal(mask[a:b]) for family, a, b, _ in self._laid_out()]
        )

    def draws_at(self, nat: NatParams, eps: jax.Array) -> jax.Array:
        """Each block's draws at its slice of ``eps``, concatenated."""
        return jnp.concatenate(
            [
                family.draws_at(part, eps[:, a:b])
                for (family, a, b, _), part in zip(self._laid_out(), self.split(nat))
            ],
            axis=-1,
        )

    def prior_site(
        self, q: NatParams, eps: jax.Array, log_density: Callable, mask: Any, use_hessian: bool
    ) -> NatParams:
        """Each block's site of ``log_density`` from the joint draws :meth:`draws_at`
        (:meth:`site_from_draws`), flat in the blocks ``log_density`` does not depend on (no
        coordinate in ``mask``)."""
        mask = np.asarray(mask)
        for family, a, b, _ in self._laid_out():
            # ValueError if a block without a prior factor is asked for one
            family.standard_normal(mask[a:b])
        zeta = self.draws_at(q, eps)
        values = jax.vmap(log_density)(zeta)
        grads = jax.vmap(jax.grad(log_density))(zeta)
        hessians = jax.vmap(jax.hessian(log_density))(zeta) if use_hessian else None
        site = self.split(self.site_from_draws(q, zeta, values, grads, hessians))
        flat = self.split(self.zeros(q.eta1.shape[-1]))
        return self.join(
            [
                part if np.any(mask[a:b]) else zero
                for (_, a, b, _), part, zero in zip(self._laid_out(), site, flat)
            ]
        )

    # ------------------------------------------------------------------ DP-SGD and the wire
    def reparameterised(self, dim: int) -> GuideParameters:
        """DP-SGD's parameters: the unconstrained values of every block's guide sites
        (:class:`~numpyro_pvi.families.reparameterised.GuideParameters`)."""
        return GuideParameters(self, dim)


def family_name(family: Any) -> str:
    return (
        repr(family)
        if isinstance(family, SiteFamilies) or type(family).__repr__ is not object.__repr__
        else f"{type(family).__name__}()"
    )
