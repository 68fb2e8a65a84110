"""Client sampling: which clients take part in a round (only some clients of a federation are
online).

A server built with ``clients_per_round=K`` draws ``K`` of its ``M`` clients per round, without
replacement, from the round's sampling key (split off the state's key: a run is reproducible from
its seed), uniformly or with the user's ``client_weights``. The clients not drawn keep their
factors; the fixed point of PVI is unchanged (every client is drawn infinitely often), so a
conjugate model still reaches the exact posterior. ``K = M`` (or ``None``) draws nothing and runs
every client, exactly as without sampling.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class ClientSampling:
    """``clients_per_round`` (an int ``K >= 1`` or a fraction in ``(0, 1]`` of the clients) and the
    weights.

    :param clients_per_round: clients per round, ``None`` for all.
    :param client_weights: relative probabilities of the clients (default uniform), one per client.
    :param owner: the server's name, for error messages.

    **Example:** ``ClientSampling(10).draw(key, 1000)`` is 10 sorted client ids out of 1000.
    """

    def __init__(
        self,
        clients_per_round: int | float | None,
        client_weights: Any = None,
        owner: str = "Server",
    ):
        self.owner = owner
        k = clients_per_round
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, (int, float, np.integer, np.floating)):
                raise ValueError(
                    f"{owner}: clients_per_round must be an int >= 1, a float fraction in (0, 1] "
                    f"or None, got {k!r}."
                )
            if isinstance(k, (int, np.integer)) and k < 1:
                raise ValueError(f"{owner}: clients_per_round must be at least 1, got {k}.")
            if isinstance(k, (float, np.floating)) and not 0.0 < k <= 1.0:
                raise ValueError(
                    f"{owner}: a float clients_per_round is a fraction of the clients in (0, 1], "
                    f"got {k}."
                )
        if client_weights is not None:
            w = np.asarray(client_weights, float)
            if w.ndim != 1 or not np.all(np.isfinite(w)) or np.any(w < 0) or not np.any(w > 0):
                raise ValueError(
                    f"{owner}: client_weights must be a 1-d array of non-negative finite weights, "
                    f"not all zero, got {client_weights!r}."
                )
            client_weights = w
        self.clients_per_round, self.client_weights = k, client_weights

    def num_sampled(self, num_clients: int) -> int:
        """``K`` for ``num_clients`` clients (a fraction rounds to the nearest count, at least
        1)."""
        k = self.clients_per_round
        if k is None:
            return num_clients
        if isinstance(k, (float, np.floating)):
            return max(1, int(round(k * num_clients)))
        return int(k)

    def check(self, num_clients: int) -> None:
        """Refuse a ``K`` or weights that do not fit ``num_clients`` clients (before anything
        compiles)."""
        k = self.num_sampled(num_clients)
        if k > num_clients:
            raise ValueError(
                f"{self.owner}: clients_per_round={k} but there are only {num_clients} clients."
            )
        if self.client_weights is not None:
            if len(self.client_weights) != num_clients:
                raise ValueError(
                    f"{self.owner}: {len(self.client_weights)} client_weights for {num_clients} "
                    "clients."
                )
            if np.count_nonzero(self.client_weights) < k:
                raise ValueError(
                    f"{self.owner}: only {np.count_nonzero(self.client_weights)} clients have a "
                    f"positive weight, fewer than clients_per_round={k}."
                )

    def active(self, num_clients: int) -> bool:
        """Whether a round runs only some of the clients (``K < M``)."""
        return self.num_sampled(num_clients) < num_clients

    def draw(self, key: jax.Array, num_clients: int, count: int | None = None) -> np.ndarray:
        """``count`` (default ``K``) distinct clients drawn with the weights from ``key``,
        sorted; uniform draws take time in ``count``, not in ``num_clients``."""
        count = self.num_sampled(num_clients) if count is None else count
        if self.client_weights is None and count < num_clients:
            # uniform: NumPy's draw without replacement, seeded from the key, takes time in
            # `count` (Floyd's algorithm where count is small), not a permutation of all clients
            seed = np.asarray(jax.random.bits(key, (4,), np.uint32))
            return np.sort(np.random.default_rng(seed).choice(num_clients, count, replace=False))
        return np.sort(self.order(key, num_clients)[:count])

    def order(self, key: jax.Array, num_clients: int) -> np.ndarray:
        """All clients in a random order, each next one drawn with probability proportional to its
        weight."""
        p = None if self.client_weights is None else self.client_weights / self.client_weights.sum()
        return np.asarray(jax.random.choice(key, num_clients, (num_clients,), replace=False, p=p))

    def suffix(self) -> str:
        """``", clients_per_round=K"`` for a server's repr, or ``""`` without sampling (reprs stay
        as they were)."""
        if self.clients_per_round is None and self.client_weights is None:
            return ""
        weights = "" if self.client_weights is None else ", client_weights=[...]"
        return f", clients_per_round={self.clients_per_round}{weights}"
