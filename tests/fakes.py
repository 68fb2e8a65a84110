"""Fake local updates (closed form, float64 checks of the server algebra and the backends) and
shared checks."""

import time

import jax
import jax.numpy as jnp
import numpy as np

import numpyro_pvi as pvi
from numpyro_pvi.families import NatParams

from models import NOISE


def assert_checkpoint_resumes(inference, result, path):
    """Save ``result``, load it back (identical state) and take one more round from both: identical
    ``q``."""
    pvi.save(result, path)
    loaded = pvi.load(path, inference.config, result.problem)
    for a, b in zip(jax.tree.leaves(result.state), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(a, b)
    resumed, _ = inference.update(loaded, result.problem)
    direct, _ = inference.update(result.state, result.problem)
    for a, b in zip(jax.tree.leaves(resumed.q), jax.tree.leaves(direct.q)):
        np.testing.assert_array_equal(a, b)


UNEQUAL = [np.arange(0, 40), np.arange(40, 130), np.arange(130, 150), np.arange(150, 300)]


class ExactLinearUpdate(pvi.local_updates.LocalUpdate):
    """The exact local optimum for `linear_model`: q_new = cavity x the client's Gaussian
    likelihood."""

    def init_state(self, problem):
        return ()

    def bind(self, problem):
        def client_update(rng_key, client, cavity, q, state, hyper=()):
            X, y = client.arrays  # leaves of ((X,), {"y": y})
            Xm = X * client.mask[:, None]
            likelihood = NatParams(Xm.T @ y / NOISE**2, -0.5 * Xm.T @ X / NOISE**2)
            return pvi.local_updates.ClientResult(cavity + likelihood - q, jnp.zeros(()), state)

        return client_update


class PoisonedUpdate(ExactLinearUpdate):
    """Returns NaN for the client holding `bad_size` rows."""

    def __init__(self, bad_size):
        self.bad_size = bad_size

    def bind(self, problem):
        exact = super().bind(problem)

        def client_update(rng_key, client, cavity, q, state, hyper=()):
            result = exact(rng_key, client, cavity, q, state)
            poison = jnp.where(client.size == self.bad_size, jnp.nan, 0.0)
            return result._replace(delta=jax.tree.map(lambda d: d + poison, result.delta))

        return client_update


class FaultyUpdate(ExactLinearUpdate):
    """The client holding `size` rows raises (mode="raise") or takes `seconds` longer
    (mode="sleep")."""

    def __init__(self, size, mode, seconds=0.0):
        self.size, self.mode, self.seconds = size, mode, seconds

    def bind(self, problem):
        exact = super().bind(problem)
        size, mode, seconds = self.size, self.mode, self.seconds

        def host(n):
            if int(n) == size:
                if mode == "raise":
                    raise RuntimeError("client failure injected by the test")
                time.sleep(seconds)
            return np.float32(0.0)

        def client_update(rng_key, client, cavity, q, state, hyper=()):
            zero = jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.float32), client.size)
            result = exact(rng_key, client, cavity, q, state)
            return result._replace(free_energy=result.free_energy + zero)

        return client_update


class NoMeanParamsGaussian(pvi.MeanFieldGaussian):
    """A mean-field Gaussian that declares no mean parameters (``mean_param_family()`` is ``None``):
    SNEP and EP's ``NUTSMoments`` must refuse it by the contract's answer, not by its class."""

    def mean_param_family(self) -> None:
        return None
