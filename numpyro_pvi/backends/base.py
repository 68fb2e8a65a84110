"""Backend contracts (:class:`Backend`, :class:`ConcurrentRunner`, :data:`ClientRunner`)
and the helpers every backend shares."""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from numpyro_pvi.local_updates.base import Client, ClientProblem, ClientResult
from numpyro_pvi.state import Rejection

# client_update(rng_key, client, cavity, q, state, hyper): q and hyper are shared, the rest is per
# client.


IN_AXES = (0, 0, 0, None, 0, None)

ClientRunner = Callable[..., ClientResult]
"""``run(ids, keys, cavities, q, states, clients, hyper) -> ClientResult`` stacked over ``ids``:
clients ``ids`` of the stacked ``clients`` update from their ``cavities`` and ``states`` (stacked
over ``ids``)."""


@runtime_checkable
class Backend(Protocol):
    """Where clients run: ``prepare(local_update, problem) -> ClientRunner``.

    ``jit_group`` says whether the runner can be traced inside ``jax.jit`` with the server's merge.
    """

    jit_group: bool

    def prepare(self, local_update: Any, problem: ClientProblem) -> ClientRunner: ...


@runtime_checkable
class ConcurrentRunner(Protocol):
    """A runner whose clients also run one by one in the background (``Asynchronous`` merges as they
    arrive).

    ``submit`` starts client ``m`` and returns a handle; ``wait_any`` blocks until one of the
    handles (``{client: handle}``) is done and returns its client; ``result`` collects it (a failed
    client gives a non-finite delta, which the merge rejects); ``cancel`` abandons handles whose
    results will never be read.
    """

    def __call__(
        self,
        ids: Any,
        keys: Any,
        cavities: Any,
        q: Any,
        states: Any,
        clients: Client,
        hyper: Any = (),
    ) -> ClientResult: ...

    def submit(
        self, m: int, key: jax.Array, cavity: Any, q: Any, state: Any, hyper: Any, clients: Client
    ) -> Any: ...

    def wait_any(self, handles: dict) -> int: ...

    def result(
        self, m: int, handle: Any, cavity: Any, state: Any, hyper: Any = ()
    ) -> ClientResult: ...

    def cancel(self, handles: dict) -> None: ...


def take(tree: Any, i: int) -> Any:
    """Entry ``i`` of every leaf of ``tree``."""
    return jax.tree.map(lambda x: x[i], tree)


def stack(trees: list) -> Any:
    """Stack pytrees of the same structure along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def failed_result(
    cavity: Any, state: Any, hyper: Any = (), failure: Rejection = Rejection.RAISED
) -> ClientResult:
    """What a failed client reports: a non-finite delta, which the server rejects, and why
    (``failure``)."""
    nan_like = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jnp.full(jnp.shape(x), jnp.nan, jnp.result_type(x)), tree
    )
    return ClientResult(
        nan_like(cavity),
        jnp.asarray(jnp.nan),
        state,
        jnp.asarray(0),
        nan_like(hyper),
        jnp.asarray(int(failure)),
    )
