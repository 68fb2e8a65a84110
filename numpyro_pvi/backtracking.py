"""Step halving: the one backtracking loop of the package.

A damped merge on the server, a natural-gradient step, a moment-matching step and the prior factor's
step all take the largest step ``step * 2**-k`` (``start <= k <= start + max_halvings``) whose
proposal is valid, and take no step at all when none is. :func:`backtrack` is that loop, under
``jit``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class Backtracked(NamedTuple):
    """The outcome of :func:`backtrack`.

    :ivar value: the proposal at the step taken (at the last step tried if none was valid).
    :ivar step: the step taken, ``0`` if no proposal was valid.
    :ivar halvings: how many times the step was halved beyond ``start`` (``max_halvings + 1`` if
        none was valid).
    :ivar valid: whether a valid proposal was found.
    """

    value: Any
    step: jax.Array
    halvings: jax.Array
    valid: jax.Array


def backtrack(
    propose: Callable[[jax.Array], tuple[Any, jax.Array]],
    step: float | jax.Array,
    max_halvings: int,
    start: int | jax.Array = 0,
) -> Backtracked:
    """Find the largest ``step * 2**-k``, ``k = start, ..., start + max_halvings``, whose proposal
    is valid.

    :param propose: ``step -> (value, valid)``, pure and traceable.
    :param step: the full step (e.g. the server's damping or a natural-gradient step size).
    :param max_halvings: how many halvings to try after the first proposal.
    :param start: halvings applied before the first try (e.g. ``1`` to start at half the step).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_pvi.backtracking import backtrack
        >>> out = backtrack(lambda s: (1.0 - 3.0 * s, 1.0 - 3.0 * s > 0), 1.0, max_halvings=5)
        >>> float(out.step), int(out.halvings), bool(out.valid)
        (0.25, 2, True)
    """
    start = jnp.asarray(start)
    # one loop that tries k = start, start + 1, ... and carries the last proposal: ``propose`` is
    # traced (and compiled) once, not three times (first try, loop body, value at the step taken)
    value, _ = jax.eval_shape(propose, step * 0.5**start)
    blank = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), value)

    def cond(carry: tuple) -> jax.Array:
        k, _, valid = carry
        return (~valid) & (k < start + max_halvings)

    def body(carry: tuple) -> tuple:
        k = carry[0] + 1
        value, valid = propose(step * 0.5**k)
        return k, value, valid

    k, value, valid = jax.lax.while_loop(cond, body, (start - 1, blank, jnp.asarray(False)))
    halvings = jnp.where(valid, k - start, max_halvings + 1)
    return Backtracked(value, jnp.where(valid, step * 0.5**k, 0.0), halvings, valid)
