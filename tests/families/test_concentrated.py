"""``families/concentrated.py``: Gamma draws whose derivative in the concentration is a custom JVP.

A program that only draws must hold no copy of ``random_gamma_grad`` (two series loops, half of a
Gamma CVI round's XLA kernels before the JVP was custom); a program that differentiates the draws
gets :func:`gamma_sample_grad` as their slope, as before.
"""

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_pvi.families.concentrated import gamma_draws, gamma_sample_grad


def _primitives(jaxpr) -> set:
    """Every primitive's name in ``jaxpr`` and its sub-jaxprs (loops, calls, custom rules)."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def test_drawing_alone_compiles_no_sample_derivative():
    """``random_gamma_grad`` is traced into its series (``lgamma``, ``digamma``, ``while`` loops):
    the draws alone hold none of it (before the custom JVP they held all of it)."""
    key, a = jax.random.PRNGKey(0), jnp.array([3.0, 40.0])
    derivative = _primitives(jax.make_jaxpr(gamma_sample_grad)(a, a).jaxpr)
    assert {"lgamma", "digamma", "while"} <= derivative
    forward = _primitives(jax.make_jaxpr(lambda a: gamma_draws(key, a, (16, 2)))(a).jaxpr)
    assert not {"lgamma", "digamma"} & forward
    # the check can fail: differentiating the draws brings the derivative in
    total = lambda a: jnp.sum(gamma_draws(key, a, (16, 2)))  # noqa: E731
    assert {"lgamma", "digamma"} <= _primitives(jax.make_jaxpr(jax.grad(total))(a).jaxpr)


def test_the_draws_derivative_is_the_implicit_reparameterisation_slope():
    key, a = jax.random.PRNGKey(1), jnp.array([0.7, 3.0, 2e4])

    @jax.jit  # one program (eagerly, each of its ~80 operations compiled one of its own)
    def draws_and_slopes(key, a):
        draws = gamma_draws(key, a, (8, 3))
        grad = jax.grad(lambda a: jnp.sum(gamma_draws(key, a, (8, 3))))(a)
        slope = jnp.sum(gamma_sample_grad(a, draws), axis=0)
        return draws, grad, slope, jax.random.gamma(key, jnp.broadcast_to(a, (8, 3)))

    draws, grad, slope, gamma = draws_and_slopes(key, a)
    np.testing.assert_allclose(grad, slope, rtol=1e-6)
    # and the draws are jax.random.gamma's, unchanged
    np.testing.assert_array_equal(draws, gamma)
