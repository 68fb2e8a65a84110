"""The interface every local update shares: a client's data, its result, and the client problem.

Every local update has the same interface: ``init_state(problem)`` gives a client's persistent
state and ``bind(problem)`` returns a pure function

``client_update(rng_key, client, cavity, q, state, hyper=()) -> ClientResult(delta, free_energy,
state)``

that a backend ``jit``s and ``vmap``s over clients. ``delta = lambda(q_new) - lambda(q)`` is the
natural-parameter change the client proposes; the server damps and merges it.

``hyper`` holds the model's hyperparameters (``numpyro.param`` sites outside the partition plate;
their unconstrained values, the same for every client; ``()`` if there are none). With
hyperparameters the client also returns ``hyper_grad``, the gradient of its local free energy with
respect to them; the server sums these and steps its own optimiser. A local update declares what it
supports with the class attributes of :class:`LocalUpdate` (``supports_local_latents``,
``supports_hyperparameters``, ``supports_factor_families``; false unless it sets them); PVI refuses
a model or family the update does not support with a clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from numpyro.distributions import kl_divergence

from numpyro_pvi.families import Family, NatParams


@runtime_checkable
class LocalUpdate(Protocol):
    r"""How a client improves its factor: ``init_state(problem)`` and ``bind(problem) ->
    client_update``.

    ``client_update(rng_key, client, cavity, q, state, hyper=()) -> ClientResult`` must be pure (a
    backend ``jit``\ s and ``vmap``\ s it). The class attributes below declare what models and
    families it handles: subclass ``LocalUpdate`` to inherit their defaults (all false: a Gaussian
    family, no local latents, no hyperparameters) and set those it supports.

    **Example:** ``isinstance(pvi.GradientUpdate(optax.adam(1e-2), num_steps=100),
    pvi.local_updates.LocalUpdate)`` is true; a new update is ``class
    MyUpdate(pvi.local_updates.LocalUpdate):`` with ``init_state`` and ``bind``.
    """

    def init_state(self, problem: ClientProblem) -> Any: ...

    def bind(self, problem: ClientProblem) -> Callable: ...

    #: whether it handles local latent variables (sites inside the partition plate)
    supports_local_latents: ClassVar[bool] = False
    #: whether it handles hyperparameters (``numpyro.param`` sites; it returns ``hyper_grad``)
    supports_hyperparameters: ClassVar[bool] = False
    #: whether it handles every :class:`~numpyro_pvi.families.FactorFamily` (else a Gaussian
    #: :class:`~numpyro_pvi.families.Family` only)
    supports_factor_families: ClassVar[bool] = False


@runtime_checkable
class CountsRejectedUpdates(Protocol):
    """A local update whose state must learn of updates the server rejected, e.g. to count what it
    released.

    The server keeps a client's new state only when its update is merged; for a rejected update that
    the client did send, it keeps ``rejected_state(old, new)`` instead (e.g. the old guides with the
    new release count).

    **Example:** ``pvi.DPGradientUpdate`` counts every release towards its privacy budget, merged or
    not.
    """

    def rejected_state(self, old: Any, new: Any) -> Any: ...


class Client(NamedTuple):
    """One client's data as a backend passes it: padded ``arrays``, ``(rows,)`` ``mask`` and
    ``size``.

    **Example:** inside ``client_update``, ``problem.log_likelihood(zeta, client, hyper)`` is the
    client's log-likelihood and ``problem.minibatch(key, client, 100)`` a mini-batch of its real
    rows.
    """

    arrays: list
    mask: jax.Array
    size: jax.Array


class ClientResult(NamedTuple):
    """What a client returns: ``delta`` (natural parameters), its local ``free_energy`` and its
    ``state``.

    ``clamped`` counts the corrections the update made to stay valid (e.g. a step size halved to
    keep ``q`` positive definite, a site variance clamped); it is reported in ``RoundInfo.clamped``.
    ``hyper_grad`` is ``d F_m / d hyper`` (unconstrained) for models with hyperparameters, else
    ``()``. ``failure`` is set by a backend whose client could not deliver (a
    :class:`~numpyro_pvi.state.Rejection` code: timed out or raised); a local update leaves it 0.
    ``inflation`` is how far the correlations of the client's tilted distribution that the family
    cannot hold inflate a variance (:func:`~numpyro_pvi.families.gaussian.variance_inflation`; EP
    and SNEP report it, 1 if not measured); the run's monitor reads it (``RoundInfo.inflation``) to
    flag a factorised EP fixed point.

    **Example:** a client that moves ``q`` to ``q_new`` returns
    ``ClientResult(delta=q_new - q, free_energy=f, state=state)``.
    """

    delta: NatParams
    free_energy: jax.Array
    state: Any
    clamped: Any = 0
    hyper_grad: Any = ()
    failure: Any = 0
    inflation: Any = 1.0


@dataclass(frozen=True)
class ClientProblem:
    """Everything a local update needs, independent of which client it runs for.

    :ivar family: the Gaussian family (a :class:`~numpyro_pvi.families.Family`).
    :ivar dim: ``D``, the size of the flat unconstrained vector.
    :ivar log_likelihood: ``(zeta, client, hyper=()) -> log p(y_m | zeta, hyper)``, a scalar; masked
        rows count 0.
    :ivar is_row: for each array of ``client.arrays``, whether its leading axis is the row axis.
    :ivar sites: the model's :class:`~numpyro_pvi.model.sites.ModelSites` (local sites with the
        padded client's shapes), or ``None``.
    :ivar local_model: ``(zeta, client, hyper) -> None`` runs the model on the client's rows with
        the global sites set to ``theta(zeta)`` and hidden, leaving its local latents and
        observations to an outer ELBO (see :func:`numpyro_pvi.model.sites.local_model`); ``None`` if
        not needed.

    **Example:** :class:`~numpyro_pvi.PVI` builds it from the model and hands it to the local
    update's ``init_state(problem)`` and ``bind(problem)``; by hand, for a model of ``D`` global
    coordinates, ``ClientProblem(pvi.MeanFieldGaussian(), D, lambda zeta, client, hyper=(): ...,
    is_row=(True,))``.
    """

    family: Family
    dim: int
    log_likelihood: Callable[[jax.Array, Client], jax.Array]
    is_row: tuple
    sites: Any = None
    local_model: Callable | None = None

    @property
    def has_local(self) -> bool:
        """Whether the model has local latent sites (continuous or enumerated)."""
        return self.sites is not None and self.sites.has_local

    @property
    def has_hyper(self) -> bool:
        """Whether the model has hyperparameters."""
        return self.sites is not None and bool(self.sites.hyper)

    def minibatch(
        self, rng_key: jax.Array, client: Client, batch_size: int
    ) -> tuple[Client, jax.Array]:
        """A batch of ``batch_size`` distinct real rows, and the factor ``size / rows`` that
        unbiases it.

        A batch larger than the client holds all its rows.
        """
        noise = jax.random.uniform(rng_key, client.mask.shape)
        _, idx = jax.lax.top_k(
            jnp.where(client.mask, noise, -1.0), min(batch_size, client.mask.shape[0])
        )
        arrays = [a[idx] if row else a for a, row in zip(client.arrays, self.is_row)]
        mask = client.mask[idx]
        return Client(arrays, mask, client.size), client.size / jnp.maximum(jnp.sum(mask), 1)


def local_free_energy(
    family: Family, q: NatParams, cavity: NatParams, loglik: Callable, zeta: jax.Array
) -> jax.Array:
    """``F_m(q) = E_q[log p(y_m | zeta)] - KL(q || cavity)``, the expectation over draws ``zeta``
    ``(S, D)`` of q."""
    return free_energy_from_values(family, q, cavity, jax.vmap(loglik)(zeta))


def free_energy_from_values(
    family: Family, q: NatParams, cavity: NatParams, values: jax.Array
) -> jax.Array:
    """:func:`local_free_energy` from ``values``, the log-likelihoods ``log p(y_m | zeta)`` at q's
    draws ``zeta`` (an update that has them already draws and evaluates no more)."""
    return jnp.mean(values) - kl_divergence(family.to_dist(q), family.to_dist(cavity))
