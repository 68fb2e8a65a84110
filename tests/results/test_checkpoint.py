import os
import pickle
import subprocess
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest
from jax import random

import numpyro_pvi as pvi

from models import linear_model

PARTS = [np.arange(0, 100), np.arange(100, 300)]
OLD_FORMAT = "numpyro_pvi.PVIState/3"


@pytest.fixture(scope="module")
def sequential_run(linear_data):
    """One round of a small Sequential run (shared: the tests below only save, load and check
    it)."""
    X, y = linear_data
    inference = pvi.PVI(
        linear_model,
        pvi.MeanFieldGaussian(),
        PARTS,
        pvi.GradientUpdate(optax.adam(1e-2), num_steps=20),
        pvi.Sequential(),
    )
    return inference, inference.run(random.PRNGKey(0), 1, X, y=y, progress_bar=False)


def renamed_model(X, y=None):
    """linear_model with its site named "v": the same flat dimension, another model."""
    v = numpyro.sample("v", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ v, 0.5), obs=y)


@pytest.mark.parametrize(
    "server", [pvi.Synchronous(0.5), pvi.Asynchronous(0.5, speeds=[1.0, 0.5])], ids=str
)
def test_resume_from_a_checkpoint_equals_an_uninterrupted_run(linear_data, tmp_path, server):
    """From ``pvi.load`` (with ``init_history``, the history saved next to the checkpoint) and from
    the result, a resumed run gives the uninterrupted run's ``q`` and history: every field but the
    rounds' wall ``time``."""
    X, y = linear_data
    update = pvi.GradientUpdate(optax.adam(1e-2), num_steps=50, num_particles=2)
    inference = pvi.PVI(linear_model, pvi.MeanFieldGaussian(), PARTS, update, server)
    straight = inference.run(random.PRNGKey(0), 4, X, y=y, progress_bar=False)
    first = inference.run(random.PRNGKey(0), 2, X, y=y, progress_bar=False)
    # a bare state: it records what it was made for itself
    pvi.save(first.state, tmp_path / "state.npz")
    # the fields that hold arrays (``clients`` is None: every round recorded every client)
    fields = {name: x for name, x in first.history._asdict().items() if x is not None}
    np.savez(tmp_path / "history.npz", **fields)
    history = pvi.RoundInfo(**np.load(tmp_path / "history.npz"))
    loaded = pvi.load(tmp_path / "state.npz", inference.config, first.problem)
    assert loaded.made_for == first.state.made_for
    from_checkpoint = inference.run(
        random.PRNGKey(1), 2, X, y=y, progress_bar=False, init_state=loaded, init_history=history
    )
    from_result = inference.run(random.PRNGKey(1), 2, X, y=y, progress_bar=False, init_state=first)
    for resumed in (from_checkpoint, from_result):
        for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
            np.testing.assert_array_equal(a, b)
        for field in pvi.RoundInfo._fields:
            if field != "time":
                np.testing.assert_array_equal(
                    getattr(resumed.history, field), getattr(straight.history, field), err_msg=field
                )
        assert resumed.history.time.shape == (4,)
    with pytest.raises(TypeError, match="init_history must be a RoundInfo"):
        inference.run(
            random.PRNGKey(1),
            1,
            X,
            y=y,
            progress_bar=False,
            init_state=first.state,
            init_history=[1.0],
        )


def test_loading_something_else_is_a_clear_error(tmp_path):
    np.savez(tmp_path / "other.npz", x=np.ones(2))
    np.save(tmp_path / "one.npy", np.ones(2))
    (tmp_path / "text.npz").write_text("not an archive")
    for name in ("other.npz", "one.npy", "text.npz"):
        with pytest.raises(ValueError, match="not a numpyro_pvi checkpoint"):
            pvi.load(tmp_path / name)


class CreatesAFile:
    """A pickle payload: unpickling it opens (creates) ``path``, as any code could run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_checkpoint_cannot_run_code(tmp_path):
    """A file of the earlier, pickled format (the structure a pickle that creates a file) is refused
    by name without unpickling it; a JSON structure naming types outside the allow-list is refused
    without calling them."""
    marker = tmp_path / "code_ran"
    payload = np.frombuffer(pickle.dumps(CreatesAFile(marker)), np.uint8)
    path = tmp_path / "old.npz"
    np.savez(
        path,
        _format=np.array(OLD_FORMAT),
        _structure=payload,
        _made_for=np.array("{}"),
        leaf_0=np.zeros(2),
    )
    with pytest.raises(
        ValueError,
        match=r"earlier format numpyro_pvi.PVIState/3, which stores "
        r"the state's tree "
        r"structure as a pickle.*refused",
    ):
        pvi.load(path)
    assert not marker.exists()
    np.savez(
        path,
        _format=np.array(pvi.results.checkpoint.FORMAT),
        _structure=np.array([CreatesAFile(marker)], object),
    )
    with pytest.raises(
        ValueError,
        match="not a loadable numpyro_pvi checkpoint: Object arrays cannot be loaded when "
        "allow_pickle=False",
    ):
        pvi.load(path)  # an object array (a pickle) in place of the JSON
    assert not marker.exists()
    open_it = '{{"namedtuple": "{}", "fields": ["file", "mode"], "children": [{}, {}]}}'
    leaf = '{{"leaf": {}, "shape": [], "dtype": "<U200"}}'
    for name, refusal in [
        ("builtins:open", "not a state type a checkpoint may hold"),
        ("io:open", "not a state type a checkpoint may hold"),
        ("numpyro_pvi.results.checkpoint:io.open", "not a NamedTuple of a module imported now"),
        ("numpyro_pvi.pvi:PVI", "not a NamedTuple of a module imported now"),
        ("numpyro_pvi.state:PVIState", "fields \\['file', 'mode'\\], which now has"),
    ]:
        structure = open_it.format(name, leaf.format(0), leaf.format(1))
        np.savez(
            path,
            _format=np.array(pvi.results.checkpoint.FORMAT),
            _structure=np.array(structure),
            leaf_0=np.array(str(marker)),
            leaf_1=np.array("w"),
        )
        with pytest.raises(
            ValueError, match=f"not a loadable numpyro_pvi checkpoint: it .*{refusal}"
        ):
            pvi.load(path)
        assert not marker.exists(), name


def test_a_checkpoint_knows_what_it_was_made_for(sequential_run, linear_data, tmp_path):
    """The state records its sites, family, server and client slots: ``load`` checks what it is
    given, a resume checks the rest, so a bare state resumed into a model with the same flat
    dimension but other sites, or under another server, is a ValueError naming the difference (both
    went ahead silently with the pickled format)."""
    X, y = linear_data
    inference, result = sequential_run
    update = inference.local_update
    assert result.state.made_for == pvi.state.MadeFor(
        (("w", (3,)),), "MeanFieldGaussian()", "Sequential(damping=1.0)", 2
    )
    path = tmp_path / "state.npz"
    pvi.save(result.state, path)  # bare
    state = pvi.load(path, inference.config, result.problem)  # the same set-up: fine
    np.testing.assert_array_equal(state.q.eta2, result.state.q.eta2)
    other_server = pvi.PVI(
        linear_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Synchronous(0.5)
    )
    server = r"server: made for 'Sequential\(damping=1.0\)', now 'Synchronous\(damping=0.5\)'"
    with pytest.raises(ValueError, match="different set-up: " + server):
        pvi.load(path, other_server.config, other_server.build(X, y=y))
    with pytest.raises(ValueError, match="different set-up: " + server):
        pvi.load(path, other_server.config)  # without the problem: the family and the server
    with pytest.raises(ValueError, match="made for another set-up: " + server):
        other_server.run(
            random.PRNGKey(0), 1, X, y=y, init_state=pvi.load(path), progress_bar=False
        )
    other_family = pvi.PVI(linear_model, pvi.FullRankGaussian(), PARTS, update, pvi.Sequential())
    with pytest.raises(
        ValueError, match="family: made for 'MeanFieldGaussian\\(\\)', now 'FullRankGaussian\\(\\)'"
    ):
        pvi.load(path, other_family.config)
    other_model = pvi.PVI(renamed_model, pvi.MeanFieldGaussian(), PARTS, update, pvi.Sequential())
    with pytest.raises(ValueError, match=r"sites: made for \[w \[3\]\], now \[v \[3\]\]"):
        pvi.load(path, other_model.config, other_model.build(X, y=y))
    with pytest.raises(
        ValueError,
        match=r"made for another set-up: sites: made for \[w \[3\]\], "
        r"now \[v \[3\]\]",
    ):
        # bare state, no check at load: the resume checks
        other_model.update(pvi.load(path), X, y=y)
    with pytest.raises(ValueError, match=r"sites: made for \[w \[3\]\], now \[w \[6\]\]"):
        inference.update(pvi.load(path), jnp.concatenate([X, X], axis=1), y=y)
    with pytest.raises(ValueError, match=r"q has shapes .*\(3,\).* need .*\(6,\)"):
        # a state built by hand records nothing: its q's shapes are checked against the model's
        unstamped = pvi.load(path)._replace(made_for=pvi.state.MadeFor())
        inference.update(unstamped, jnp.concatenate([X, X], axis=1), y=y)
    with pytest.raises(ValueError, match="client slots: made for 2, now 3"):
        pvi.PVI(
            linear_model,
            pvi.MeanFieldGaussian(),
            [*PARTS[:1], PARTS[1][:100], PARTS[1][100:]],
            update,
            pvi.Sequential(),
        ).update(pvi.load(path), X, y=y)
    with pytest.raises(ValueError, match="nothing was written"):
        pvi.save(
            result.state, tmp_path / "other.npz", other_model.config, other_model.build(X, y=y)
        )
    assert not (tmp_path / "other.npz").exists()


KILLED_SAVE = """
import resource, signal, sys
sys.path.insert(0, "tests")
import jax.numpy as jnp
import numpy as np
import numpyro_pvi as pvi
state = pvi.load(sys.argv[1])
# a larger file than the limit allows
bigger = state._replace(client_states=np.zeros((200_000,), np.float32))
# a write past the limit fails (EFBIG) instead of killing us
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
try:
    pvi.save(bigger, sys.argv[1])
except OSError as e:
    print("save failed:", e.strerror)
"""


def test_a_failed_save_keeps_the_previous_checkpoint(sequential_run, tmp_path):
    _, result = sequential_run
    path = tmp_path / "state.npz"
    pvi.save(result, path)
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE)
    out = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, check=True
    )
    assert "save failed: File too large" in out.stdout, out.stdout + out.stderr
    # the old checkpoint survived
    np.testing.assert_array_equal(pvi.load(path).q.eta1, result.state.q.eta1)
    # no debris
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pvi-checkpoint")] == []
    with pytest.raises(TypeError, match="nothing was written"):
        pvi.save(result.history, path)
    np.testing.assert_array_equal(pvi.load(path).q.eta1, result.state.q.eta1)


@pytest.mark.skipif(
    os.name != "posix", reason="the writer's process is probed with os.kill(pid, 0)"
)
def test_a_killed_saves_temporary_is_removed_by_the_next_save(sequential_run, tmp_path):
    """``kill -9`` during a save leaves its temporary behind (named with the writer's host and pid):
    the next save into the folder removes it once its writer's process is gone, and leaves live
    writers' and other hosts' alone."""
    _, result = sequential_run
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()  # reaped: its pid names no process now
    host = pvi.results.checkpoint._host()
    names = {
        "dead": f".pvi-checkpoint-{host}-{finished.pid}-k1ll3d_x.npz",
        # a concurrent save of this process
        "live": f".pvi-checkpoint-{host}-{os.getpid()}-wr1t1ng_.npz",
        "other host": f".pvi-checkpoint-{host}x-{finished.pid}-0th3rh0s.npz",
        "old naming, stale": ".pvi-checkpoint-abcd1234.npz",
        "old naming, fresh": ".pvi-checkpoint-efgh5678.npz",
        "not ours": "pvi-checkpoint-notours.npz",
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 1000)
    hours_ago = time.time() - 2 * 3600
    os.utime(tmp_path / names["old naming, stale"], (hours_ago, hours_ago))
    pvi.save(result, tmp_path / "state.npz")
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"state.npz"} | {
        names[k] for k in ("live", "other host", "old naming, fresh", "not ours")
    }


class OwnState(NamedTuple):
    """A user's local-update state type: outside the allow-list until registered."""

    count: jax.Array


def test_every_kind_of_state_round_trips(linear_data, tmp_path):
    """The states of every local update, server and damping (with hyperparameters, an optax state,
    local latents, a typed key) come back identical: tree structure, values and dtypes. Save
    refuses, writing nothing, a state it could not load back."""
    X, y = linear_data[0][:40, :2], linear_data[1][:40]
    parts = [np.arange(0, 20), np.arange(20, 40)]

    def latent_model(X, y=None):  # a hyperparameter and a local latent site
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        s = numpyro.param("s", 1.0, constraint=dist.constraints.positive)
        with pvi.partition_plate("data", X.shape[0]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Normal(X @ w + z, s), obs=y)

    def gamma_model(X, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
        with pvi.partition_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ w, 1 / jnp.sqrt(tau)), obs=y)

    adam = pvi.GradientUpdate(optax.adam(1e-2), num_steps=5)
    cases = [
        (latent_model, pvi.FullRankGaussian(), adam, pvi.Asynchronous(pvi.AdaptiveDamping())),
        (linear_model, pvi.MeanFieldGaussian(), adam, pvi.Synchronous()),  # HeavyBall
        (linear_model, pvi.MeanFieldGaussian(), pvi.MomentMatchingUpdate(), pvi.Continual()),
        (linear_model, pvi.MeanFieldGaussian(), pvi.SNEPUpdate(), pvi.Sequential()),
        (gamma_model, pvi.SiteFamilies({"tau": pvi.Gamma()}), pvi.SNEPUpdate(), pvi.Sequential()),
        (
            linear_model,
            pvi.MeanFieldGaussian(),
            pvi.DPGradientUpdate(
                optax.adam(1e-2), num_steps=5, batch_size=5, clip_norm=1.0, noise_multiplier=1.0
            ),
            pvi.Synchronous(0.5),
        ),
        (
            linear_model,
            pvi.MeanFieldGaussian(),
            pvi.DPLocalAveraging(adam, num_shards=2, clip_norm=1.0, noise_multiplier=1.0),
            pvi.Synchronous(0.5),
        ),
    ]
    path = tmp_path / "state.npz"
    for model, family, update, server in cases:
        inference = pvi.PVI(model, family, parts, update, server)
        state = inference.init(random.PRNGKey(0), X, y=y)
        pvi.save(state, path)
        loaded = pvi.load(path, inference.config, inference.build(X, y=y))
        assert jax.tree.structure(loaded) == jax.tree.structure(state), (update, server)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(loaded)):
            assert jnp.result_type(a) == jnp.result_type(b), (update, server)
            np.testing.assert_array_equal(a, b)
    typed = state._replace(
        rng_key=random.key(3), client_states=OwnState(jnp.arange(3, dtype=jnp.bfloat16))
    )
    with pytest.raises(
        TypeError, match="test_checkpoint:OwnState, which a checkpoint does not load.*nothing"
    ):
        pvi.save(typed, path)
    pvi.results.checkpoint.register_state_type(OwnState)
    pvi.save(typed, path)
    loaded = pvi.load(path)
    assert jax.tree.structure(loaded) == jax.tree.structure(typed)
    np.testing.assert_array_equal(random.key_data(loaded.rng_key), random.key_data(typed.rng_key))
    assert loaded.client_states.count.dtype == jnp.bfloat16
    np.testing.assert_array_equal(loaded.client_states.count, typed.client_states.count)
    with pytest.raises(TypeError, match="keys.*nothing was written"):
        pvi.save(state._replace(client_states={("a", 1): jnp.zeros(2)}), tmp_path / "never.npz")
    assert not (tmp_path / "never.npz").exists()


def test_a_checkpoint_of_0_1_names_its_types_by_their_old_modules_and_loads(
    sequential_run, tmp_path
):
    """0.2 moved the modules of several state types (CHANGELOG.md): a 0.1 file names them by the
    old module (``numpyro_pvi.damping:FixedDampingState``), which loading reads as the new one."""
    _, result = sequential_run
    path = tmp_path / "state.npz"
    pvi.save(result, path)
    with np.load(path, allow_pickle=False) as saved:
        arrays = dict(saved)
    structure = str(arrays["_structure"])
    old = {new: old for old, new in pvi.results.checkpoint.MOVED_MODULES.items()}
    written_by_0_1 = structure
    for new, before in old.items():
        written_by_0_1 = written_by_0_1.replace(f'"{new}:', f'"{before}:')
    assert written_by_0_1 != structure  # the state does hold a type of a moved module
    arrays["_structure"] = np.array(written_by_0_1)
    np.savez(path, **arrays)
    loaded = pvi.load(path)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(result.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(loaded) == jax.tree.structure(result.state)
