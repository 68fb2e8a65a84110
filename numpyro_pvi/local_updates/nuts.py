"""NUTS chains with a unit mass matrix in coordinates where one fits: what
``MomentMatchingUpdate(tilted="nuts")`` runs.

NumPyro's functional ``hmc(potential_fn, algo="NUTS")`` kernels in ``lax.scan``: step-size
adaptation over the warm-up, the mass matrix fixed at the identity (the coordinates are whitened by
a Gaussian approximation, or standardised by a family's
:meth:`~numpyro_pvi.families.MeanParamFamily.chain_frame`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from numpyro.infer.hmc import hmc


class NUTSSettings(NamedTuple):
    """How many NUTS chains, warm-up steps and draws per chain, and the tree depth
    (``MomentMatchingUpdate``'s)."""

    num_chains: int
    num_warmup: int
    num_samples: int
    max_tree_depth: int


def nuts_draws(
    potential: Callable,
    dim: int,
    rng_key: jax.Array,
    num_chains: int,
    num_warmup: int,
    num_samples: int,
    max_tree_depth: int,
) -> jax.Array:
    """``(num_chains * num_samples, dim)`` draws of ``exp(-potential(u))`` after ``num_warmup``
    adapted steps per chain.

    Each chain starts at ``N(0, 0.1^2)`` (the coordinates are centred on the target's bulk).

    **Example:** draws of ``N(1, 1)``:

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> from numpyro_pvi.local_updates.nuts import nuts_draws
        >>> u = nuts_draws(
        ...     lambda u: 0.5 * jnp.sum((u - 1.0) ** 2), 1, jax.random.PRNGKey(0), 2, 100, 500, 4
        ... )
        >>> u.shape, bool(abs(float(u.mean()) - 1.0) < 0.2)
        ((1000, 1), True)
    """
    init_kernel, sample_kernel = hmc(potential_fn=potential, algo="NUTS")

    def chain(key: jax.Array) -> jax.Array:
        init_key, start_key = jax.random.split(key)
        u0 = 0.1 * jax.random.normal(start_key, (dim,))
        state = init_kernel(
            u0,
            num_warmup,
            step_size=0.5,
            adapt_mass_matrix=False,
            max_tree_depth=max_tree_depth,
            rng_key=init_key,
        )
        state, _ = jax.lax.scan(
            lambda s, _: (sample_kernel(s), None), state, None, length=num_warmup
        )
        _, us = jax.lax.scan(lambda s, _: (sample_kernel(s),) * 2, state, None, length=num_samples)
        return us.z

    return jax.vmap(chain)(jax.random.split(rng_key, num_chains)).reshape(-1, dim)
