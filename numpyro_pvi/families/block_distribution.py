"""``BlockDistribution``: independent distributions over consecutive slices of one flat vector
(``SiteFamilies``' q)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.distributions.kl import kl_divergence


class BlockDistribution(dist.Distribution):
    """Independent distributions over consecutive slices of one ``(D,)`` vector (each with event
    shape ``(k,)``).

    Reparameterised when every part is; ``kl_divergence`` of two with the same slices is the sum of
    the parts'.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, numpyro.distributions as dist
        >>> from numpyro_pvi.families.block_distribution import BlockDistribution
        >>> d = BlockDistribution(
        ...     [dist.Normal(jnp.zeros(2), 1.0).to_event(1), dist.Gamma(jnp.ones(1)).to_event(1)]
        ... )
        >>> d.event_shape, round(float(d.log_prob(jnp.array([0.0, 0.0, 1.0]))), 4)
        ((3,), -2.8379)
    """

    arg_constraints: dict = {}
    support = constraints.real_vector
    pytree_data_fields = ("parts",)
    pytree_aux_fields = ("sizes",)

    def __init__(self, parts: list, validate_args: bool | None = None) -> None:
        self.parts = tuple(parts)
        self.sizes = tuple(int(p.event_shape[-1]) for p in self.parts)
        super().__init__(
            batch_shape=(), event_shape=(sum(self.sizes),), validate_args=validate_args
        )

    @property
    def has_rsample(self) -> bool:
        return all(p.has_rsample for p in self.parts)

    def _split(self, value: jax.Array) -> list:
        bounds = np.cumsum((0,) + self.sizes)
        return [value[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def sample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        keys = jax.random.split(key, len(self.parts))
        return jnp.concatenate(
            [p.sample(k, sample_shape) for p, k in zip(self.parts, keys)], axis=-1
        )

    def rsample(self, key: jax.Array, sample_shape: tuple = ()) -> jax.Array:
        keys = jax.random.split(key, len(self.parts))
        return jnp.concatenate(
            [p.rsample(k, sample_shape) for p, k in zip(self.parts, keys)], axis=-1
        )

    def log_prob(self, value: jax.Array) -> jax.Array:
        return sum(p.log_prob(v) for p, v in zip(self.parts, self._split(value)))

    def entropy(self) -> jax.Array:
        return sum(p.entropy() for p in self.parts)

    @property
    def mean(self) -> jax.Array:
        return jnp.concatenate([p.mean for p in self.parts], axis=-1)

    @property
    def variance(self) -> jax.Array:
        return jnp.concatenate([p.variance for p in self.parts], axis=-1)


@kl_divergence.register(BlockDistribution, BlockDistribution)
def _kl_blocks(p: BlockDistribution, q: BlockDistribution) -> jax.Array:
    if p.sizes != q.sizes:
        raise NotImplementedError("KL of block distributions with different blocks.")
    return sum(kl_divergence(a, b) for a, b in zip(p.parts, q.parts))
