import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

from conftest import linear_model

PARTS = [np.arange(0, 100), np.arange(100, 300)]


@pytest.mark.parametrize("server", [pvi.Synchronous(0.5), pvi.Asynchronous(0.5, speeds=[1.0, 0.5])], ids=str)
def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(linear_data, tmp_path, server):
    X, y = linear_data
    update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=50, num_particles=2)
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, server)
    straight = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False)
    first = inference.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False)
    path = tmp_path / "state.npz"
    pvi.save(first.state, path)
    resumed = inference.run(random.PRNGKey(1), 2, X, y=y, progress_bar=False, init_state=pvi.load(path))
    for a, b in zip(np.asarray(straight.state.q), np.asarray(resumed.state.q)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(straight.history.elbo[2:], resumed.history.elbo)


def test_loading_something_else_is_a_clear_error(tmp_path):
    path = tmp_path / "other.npz"
    np.savez(path, x=np.ones(2))
    with pytest.raises(ValueError, match="not a numpyro_pvi checkpoint"):
        pvi.load(path)


KILLED_SAVE = """
import resource, signal, sys
sys.path.insert(0, "tests")
import jax.numpy as jnp
import numpy as np
import numpyro_pvi as pvi
state = pvi.load(sys.argv[1])
bigger = state._replace(client_states=np.zeros((200_000,), np.float32))  # a larger file than the limit allows
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    pvi.save(bigger, sys.argv[1])
except OSError as e:
    print("save failed:", e.strerror)
"""


def test_a_failed_save_keeps_the_previous_checkpoint(linear_data, tmp_path):
    import subprocess
    import sys

    X, y = linear_data
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS,
                        pvi.GradientUpdate(optax.adam(1e-2), num_steps=20), pvi.Sequential())
    result = inference.run(random.PRNGKey(0), 1, X, y=y, progress_bar=False)
    path = tmp_path / "state.npz"
    pvi.save(result, path)
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE)
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, check=True)
    assert "save failed: File too large" in out.stdout, out.stdout + out.stderr
    np.testing.assert_array_equal(pvi.load(path).q.eta1, result.state.q.eta1)  # the old checkpoint survived
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pvi-checkpoint")] == []  # no debris
    with pytest.raises(TypeError, match="nothing was written"):
        pvi.save(result.history, path)
    np.testing.assert_array_equal(pvi.load(path).q.eta1, result.state.q.eta1)


def test_a_checkpoint_knows_what_it_was_made_for(linear_data, tmp_path):
    X, y = linear_data
    update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=20)
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential())
    result = inference.run(random.PRNGKey(0), 1, X, y=y, progress_bar=False)
    path = tmp_path / "state.npz"
    pvi.save(result, path)
    state = pvi.load(path, inference, result.problem)  # the same set-up: fine
    np.testing.assert_array_equal(state.q.eta2, result.state.q.eta2)
    other_server = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Synchronous(0.5))
    with pytest.raises(ValueError, match=r"different set-up: server: saved 'Sequential\(damping=1.0\)'"):
        pvi.load(path, other_server, other_server.build(X, y=y))
    other_family = pvi.PVI(linear_model, pvi.FullRankGaussian(), PARTS, update, pvi.Sequential())
    with pytest.raises(ValueError, match="family: saved 'MeanFieldGaussian', now 'FullRankGaussian'"):
        pvi.load(path, other_family, other_family.build(X, y=y))

    def renamed(X, y=None):  # the same dimension, another site: would continue silently without the record
        import numpyro
        import numpyro.distributions as dist

        v = numpyro.sample("v", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ v, 0.5), obs=y)

    other_model = pvi.PVI(renamed, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential())
    with pytest.raises(ValueError, match=r"sites: saved \[\['w', \[3\]\]\], now \[\['v', \[3\]\]\]"):
        pvi.load(path, other_model, other_model.build(X, y=y))
    wider = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential())
    with pytest.raises(ValueError, match="was it made for another model or family"):
        wider.update(pvi.load(path), jnp.concatenate([X, X], axis=1), y=y)  # 6 coordinates, the state has 3


def test_a_resumed_run_continues_the_history(linear_data, tmp_path):
    """``run(init_state=state, init_history=...)`` after ``pvi.load`` (the history saved next to the checkpoint), and
    ``run(init_state=result)``, give the uninterrupted run's history: every field but the rounds' wall ``time``."""
    X, y = linear_data
    update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=50, num_particles=2)
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Synchronous(0.5))
    straight = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False)
    first = inference.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False)
    pvi.save(first, tmp_path / "state.npz")
    np.savez(tmp_path / "history.npz", **first.history._asdict())
    history = pvi.RoundInfo(**np.load(tmp_path / "history.npz"))
    from_checkpoint = inference.run(random.PRNGKey(1), 2, X, y=y, progress_bar=False,
                                    init_state=pvi.load(tmp_path / "state.npz"), init_history=history)
    from_result = inference.run(random.PRNGKey(1), 2, X, y=y, progress_bar=False, init_state=first)
    for resumed in (from_checkpoint, from_result):
        for field in pvi.RoundInfo._fields:
            if field != "time":
                np.testing.assert_array_equal(getattr(resumed.history, field), getattr(straight.history, field),
                                              err_msg=field)
        assert resumed.history.time.shape == (4,)
    with pytest.raises(TypeError, match="init_history must be a RoundInfo"):
        inference.run(random.PRNGKey(1), 1, X, y=y, progress_bar=False, init_state=first.state, init_history=[1.0])
