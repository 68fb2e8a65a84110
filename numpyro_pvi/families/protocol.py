"""The contract of a family: :class:`Family`, with :class:`NatParams` and :class:`Marginals`.

Every family stores its second-order quantities (``eta2``, a precision, a covariance, an expected
Hessian) in its own **form**: ``MeanFieldGaussian`` a ``(D,)`` diagonal, ``FullRankGaussian`` a
``(D, D)`` matrix. The local updates, the prior and the plots never look at that form: they only
pass it between the family's methods, which is why adding a family is adding one class.
:class:`NatParams` and
:class:`Marginals` live in :mod:`numpyro_pvi.families.params`, the smaller contract
:class:`FactorFamily` in :mod:`numpyro_pvi.families.factor`; both are re-exported here.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpyro.distributions as dist
from numpyro.distributions import constraints

from numpyro_pvi.families.factor import FactorFamily
from numpyro_pvi.families.params import Marginals, NatParams

__all__ = ["Family", "FactorFamily", "Marginals", "NatParams"]


@runtime_checkable
class Family(FactorFamily, Protocol):
    """What a family of Gaussian factors over the flat unconstrained vector ``zeta`` (size ``D``)
    implements.

    ``q``, the prior and every factor ``t_m`` are :class:`NatParams` of one family; factors may be
    improper, ``q`` and cavities must be valid. "Form" below is the family's own storage of a
    symmetric ``(D, D)`` matrix (a ``(D,)`` diagonal for mean field, the matrix for full rank), and
    ``scale`` is the guide's scale (a ``(D,)`` sd vector or a ``(D, D)`` lower Cholesky factor
    ``L``). A new family implements every member below (subclassing
    ``numpyro_pvi.families.gaussian.GaussianFamily`` gives ``to_dist``, ``dense_precision``, the
    :class:`FactorFamily` and :class:`~numpyro_pvi.families.MeanParamFamily` members, and SNEP's
    estimator, which needs the whitened moments and form algebra of
    :class:`~numpyro_pvi.families.gaussian_chains.WhitenedForm` as well):

    * **Guide and core** (used by PVI, the servers and ``GradientUpdate``): ``scale_name``,
      ``scale_constraint``, :meth:`zeros`, :meth:`is_valid`, :meth:`precision`,
      :meth:`from_mean_precision`, :meth:`loc_scale`, :meth:`from_loc_scale`, :meth:`distribution`,
      :meth:`to_dist`.
    * **Moments**: :meth:`moments`, :meth:`from_moments`, :meth:`from_dense_precision`.
    * **Densities**: :meth:`quadratic`, :meth:`dense_precision`, :meth:`marginals`.
    * **Forms** (matrix algebra in the family's form): :meth:`to_dense`, :meth:`from_dense`,
      :meth:`identity`, :meth:`outer`, :meth:`outer_sum`, :meth:`sym`.
    * **Whitening** ``zeta = loc + L u`` (sampling, CVI, SNEP's chains): :meth:`unwhiten`,
      :meth:`whiten`.
    * **Sites**: :meth:`stein_hessian`, :meth:`site_update` (the CVI site), :meth:`with_block` (the
      prior's exact Gaussian blocks).

    Sampling is ``to_dist(nat).sample(key, shape)``.

    **Example:**

    .. doctest::

        >>> import numpyro_pvi as pvi
        >>> from numpyro_pvi.families import Family
        >>> isinstance(pvi.MeanFieldGaussian(), Family), isinstance(pvi.FullRankGaussian(), Family)
        (True, True)
        >>> isinstance(pvi.FullRankGaussian(), pvi.MeanFieldGaussian)
        False
    """

    scale_name: str
    scale_constraint: constraints.Constraint

    # ------------------------------------------------------------------ guide and core
    def zeros(self, dim: int) -> NatParams:
        """The flat factor ``t = 1``."""
        ...

    def is_valid(self, nat: NatParams) -> jax.Array:
        """Whether ``nat`` is a proper, finite Gaussian (positive-definite precision)."""
        ...

    def precision(self, nat: NatParams) -> jax.Array:
        """The precision ``-2 eta2`` (symmetrised), in the family's form."""
        ...

    def from_mean_precision(self, loc: jax.Array, precision: jax.Array) -> NatParams:
        """From a mean ``(D,)`` and a precision in the family's form."""
        ...

    def loc_scale(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """The guide's ``(loc, scale)`` of valid natural parameters."""
        ...

    def from_loc_scale(self, loc: jax.Array, scale: jax.Array) -> NatParams:
        """From the guide's ``(loc, scale)``."""
        ...

    def distribution(self, loc: jax.Array, scale: jax.Array) -> dist.Distribution:
        """The NumPyro distribution over ``zeta`` with the guide's parameters."""
        ...

    def to_dist(self, nat: NatParams) -> dist.Distribution:
        """``q`` as a NumPyro distribution over ``zeta``."""
        ...

    # ------------------------------------------------------------------ moments
    def moments(self, nat: NatParams) -> tuple[jax.Array, jax.Array]:
        """Mean ``(D,)`` and covariance (in the family's form) of valid natural parameters.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().moments(
        ...     pvi.MeanFieldGaussian().from_loc_scale(jnp.ones(2), jnp.array([2.0, 2.0]))
        ... )
        (Array([1., 1.], dtype=float32), Array([4., 4.], dtype=float32))
        """
        ...

    def from_moments(self, mean: jax.Array, cov: jax.Array) -> NatParams:
        """The member with this mean and covariance (in the family's form; see :meth:`from_dense`).

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.FullRankGaussian().from_moments(jnp.array([1.0, 2.0]), 4.0 * jnp.eye(2)).eta1
        Array([0.25, 0.5 ], dtype=float32)
        """
        ...

    def from_dense_precision(self, mean: jax.Array, precision: jax.Array) -> NatParams:
        """The member matching the moments of ``N(mean, precision^{-1})``, ``precision`` ``(D, D)``.

        For mean field these are the marginal variances, not the precision's diagonal:

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> nat = pvi.MeanFieldGaussian().from_dense_precision(
        ...     jnp.zeros(2), jnp.array([[2.0, 1.0], [1.0, 2.0]])
        ... )
        >>> pvi.MeanFieldGaussian().precision(nat)  # 1 / (2/3)
        Array([1.5, 1.5], dtype=float32)
        """
        ...

    # ------------------------------------------------------------------ densities
    def quadratic(self, nat: NatParams, zeta: jax.Array) -> jax.Array:
        """``eta1 . zeta + zeta^T eta2 zeta``, an unnormalised log density (``nat`` may be
        improper).

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.families import NatParams
        >>> pvi.FullRankGaussian().quadratic(
        ...     NatParams(jnp.ones(2), -jnp.eye(2)), jnp.array([1.0, 2.0])
        ... )
        Array(-2., dtype=float32)
        """
        ...

    def dense_precision(self, nat: NatParams) -> jax.Array:
        """The ``(D, D)`` precision matrix.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> from numpyro_pvi.families import NatParams
        >>> pvi.MeanFieldGaussian().dense_precision(
        ...     NatParams(jnp.zeros(2), jnp.array([-0.5, -1.0]))
        ... )
        Array([[1., 0.],
               [0., 2.]], dtype=float32)
        """
        ...

    def marginals(self, nat: Any) -> Marginals:
        """Marginal means, variances and precision diagonal in float64 numpy (NaN where improper).

        ``nat`` must hold concrete (not traced) arrays; see :class:`Marginals` for an example.
        """
        ...

    # ------------------------------------------------------------------ forms
    def to_dense(self, matrix: jax.Array) -> jax.Array:
        """A matrix in the family's form as a dense ``(D, D)`` matrix.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().to_dense(jnp.array([1.0, 2.0]))
        Array([[1., 0.],
               [0., 2.]], dtype=float32)
        """
        ...

    def from_dense(self, matrix: jax.Array) -> jax.Array:
        """The family's form of a dense ``(D, D)`` symmetric matrix (its diagonal for mean field).

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().from_dense(jnp.array([[1.0, 0.5], [0.5, 2.0]]))
        Array([1., 2.], dtype=float32)
        """
        ...

    def identity(self, dim: int) -> jax.Array:
        """The identity matrix in the family's form.

        >>> import numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().identity(2), pvi.FullRankGaussian().identity(2).shape
        (Array([1., 1.], dtype=float32), (2, 2))
        """
        ...

    def outer(self, a: jax.Array, b: jax.Array) -> jax.Array:
        """``a b^T`` of two ``(D,)`` vectors, in the family's form.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().outer(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]))
        Array([3., 8.], dtype=float32)
        """
        ...

    def outer_sum(self, x: jax.Array, y: jax.Array) -> jax.Array:
        """``sum_i x_i y_i^T`` over the rows of ``x``, ``y`` ``(S, D)``, in the family's form.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.FullRankGaussian().outer_sum(jnp.ones((3, 2)), jnp.ones((3, 2)))
        Array([[3., 3.],
               [3., 3.]], dtype=float32)
        """
        ...

    def sym(self, matrix: jax.Array) -> jax.Array:
        """The symmetric part ``(M + M^T) / 2``.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.FullRankGaussian().sym(jnp.array([[1.0, 2.0], [0.0, 1.0]]))
        Array([[1., 1.],
               [1., 1.]], dtype=float32)
        """
        ...

    # ------------------------------------------------------------------ whitening zeta = loc + L u
    def unwhiten(self, loc: jax.Array, scale: jax.Array, u: jax.Array) -> jax.Array:
        """``loc + L u`` for every row ``u`` of ``(..., D)``; ``(loc, scale)`` as from
        :meth:`loc_scale`.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.FullRankGaussian().unwhiten(
        ...     jnp.zeros(2), jnp.array([[2.0, 0.0], [1.0, 1.0]]), jnp.ones(2)
        ... )
        Array([2., 2.], dtype=float32)
        """
        ...

    def whiten(self, loc: jax.Array, scale: jax.Array, zeta: jax.Array) -> jax.Array:
        """``L^{-1} (zeta - loc)`` for every row of ``(..., D)``: the inverse of :meth:`unwhiten`.

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.FullRankGaussian().whiten(
        ...     jnp.zeros(2), jnp.array([[2.0, 0.0], [1.0, 1.0]]), jnp.full(2, 2.0)
        ... )
        Array([1., 1.], dtype=float32)
        """
        ...

    # ------------------------------------------------------------------ sites
    def stein_hessian(self, grads: jax.Array, eps: jax.Array, scale: jax.Array) -> jax.Array:
        """``E_q[Hessian]`` (family form) from gradients ``(S, D)`` at ``zeta = unwhiten(loc, scale,
        eps)``.

        By Stein's lemma, ``E[g eps^T] L^{-1}``; for ``f(z) = -z^2`` (Hessian ``-2``) at ``zeta = 3
        eps``:

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> eps = jnp.array([[1.0], [-1.0]])
        >>> pvi.MeanFieldGaussian().stein_hessian(-2.0 * (3.0 * eps), eps, jnp.full(1, 3.0))
        Array([-2.], dtype=float32)
        """
        ...

    def site_update(self, grad_mean: jax.Array, hess_mean: jax.Array, loc: jax.Array) -> NatParams:
        """The CVI site ``grad_mu E_q[f]`` from ``E_q[grad f]``, ``E_q[hess f]`` (family form) and
        ``q``'s mean.

        ``eta2 = E_q[H] / 2`` and ``eta1 = E_q[g] - E_q[H] mu`` (Bonnet / Price; see
        :func:`expected_site`):

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().site_update(jnp.ones(1), jnp.array([-2.0]), jnp.ones(1))
        NatParams(eta1=Array([3.], dtype=float32), eta2=Array([-1.], dtype=float32))
        """
        ...

    def with_block(self, precision: jax.Array, block: slice, values: jax.Array) -> jax.Array | None:
        """``precision`` (family form) with the block ``[block, block]`` set to ``values``.

        ``values`` is a ``(k,)`` diagonal or a ``(k, k)`` matrix; ``None`` if the family cannot hold
        it exactly (a full block in a mean-field precision).

        >>> import jax.numpy as jnp, numpyro_pvi as pvi
        >>> pvi.MeanFieldGaussian().with_block(jnp.zeros(3), slice(1, 3), jnp.array([2.0, 3.0]))
        Array([0., 2., 3.], dtype=float32)
        >>> pvi.MeanFieldGaussian().with_block(jnp.zeros(3), slice(1, 3), jnp.eye(2)) is None
        True
        """
        ...
