"""Plots: each returns a Figure whose artists carry the run's numbers."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402
from jax import random  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import numpyro_pvi as pvi  # noqa: E402
from numpyro_pvi.results.arviz import to_arviz  # noqa: E402
from numpyro_pvi.results.plot import plot_clients, plot_compare, plot_history  # noqa: E402

from models import logistic_model  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def scale_model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[1]]).to_event(1))
    sigma = numpyro.sample("sigma", dist.LogNormal(0.0, 1.0))
    with pvi.partition_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, sigma), obs=y)


def update(num_steps=300):
    return pvi.GradientUpdate(
        optax.adam(optax.exponential_decay(5e-2, num_steps, 0.05)),
        num_steps=num_steps,
        num_particles=4,
    )


@pytest.fixture(scope="module")
def fitted(logistic_data):
    X, y = logistic_data
    inference = pvi.PVI(
        logistic_model,
        pvi.MeanFieldGaussian(),
        pvi.split_iid(random.PRNGKey(0), X.shape[0], 5),
        update(),
        pvi.Synchronous(0.5),
    )
    return inference.run(random.PRNGKey(1), 4, X, y=y, progress_bar=False)


def synthetic_history(num_rounds=4, num_clients=3):
    shape = (num_rounds, num_clients)
    accepted = np.ones(shape, int)
    accepted[2, 1] = 0  # client 1's update of round 3 was rejected
    free_energy = -np.arange(num_rounds * num_clients, dtype=float).reshape(shape)
    free_energy[0, 2] = np.nan  # client 2 not visited in round 1
    return pvi.RoundInfo(
        elbo=np.linspace(-50.0, -10.0, num_rounds),
        free_energy=free_energy,
        attempts=np.ones(shape, int),
        accepted=accepted,
        damping=accepted * 0.5,
        clamped=np.zeros(shape, int),
        time=np.ones(num_rounds),
    )


# ----------------------------------------------------------------------------- plot_history


def test_plot_history_draws_the_elbo_the_change_and_every_client(fitted):
    fig = plot_history(fitted, tol=0.05)
    assert isinstance(fig, Figure)
    ax_elbo, ax_change, ax_local = fig.axes
    # the change of q per round beside the ELBO, on a log scale, with tol as a horizontal line
    assert ax_change.get_yscale() == "log"
    np.testing.assert_allclose(ax_change.lines[0].get_ydata(), fitted.history.change)
    np.testing.assert_allclose(ax_change.lines[1].get_ydata(), [0.05, 0.05])
    assert "tol = 0.05" in [t.get_text() for t in ax_change.get_legend().get_texts()]
    np.testing.assert_allclose(ax_elbo.lines[0].get_ydata(), fitted.history.elbo)
    np.testing.assert_array_equal(ax_elbo.lines[0].get_xdata(), [1, 2, 3, 4])
    client_lines = [line for line in ax_local.lines if line.get_label().startswith("client")]
    assert len(client_lines) == 5
    for m, line in enumerate(client_lines):
        np.testing.assert_allclose(line.get_ydata(), fitted.history.free_energy[:, m])
    assert not any(line.get_label() == "rejected update" for line in ax_local.lines)


def test_plot_history_marks_rejected_updates_and_accepts_a_history():
    history = synthetic_history()
    fig = plot_history(history, clients=[1, 2])
    ax_local = fig.axes[1]  # a history without RoundInfo.change: no change panel
    labels = [line.get_label() for line in ax_local.lines]
    assert (
        labels.count("client 1") == 1 and labels.count("client 2") == 1 and "client 0" not in labels
    )
    crosses = [
        line for line in ax_local.lines if line.get_marker() == "x" and len(line.get_xdata())
    ]
    assert len(crosses) == 1
    np.testing.assert_array_equal(crosses[0].get_xdata(), [3])
    assert "rejected update" in [t.get_text() for t in ax_local.get_legend().get_texts()]


def test_plot_history_needs_a_history(fitted):
    with pytest.raises(ValueError, match="history"):
        plot_history(fitted._replace(history=None))


# ----------------------------------------------------------------------------- plot_compare


def test_plot_compare_accepts_results_dicts_and_inference_data(fitted):
    rng = np.random.default_rng(0)
    reference = {"w": rng.normal(0.0, 0.1, (800, 3)), "b": rng.normal(-0.3, 0.1, 800)}
    fig = plot_compare(
        {"PVI": fitted, "ArviZ": to_arviz(fitted, num_samples=400), "reference": reference}
    )
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == ["w[0]", "w[1]", "w[2]", "b"]
    densities = [
        line for line in visible[3].lines if line.get_label() in ("PVI", "ArviZ", "reference")
    ]
    assert [line.get_label() for line in densities] == ["PVI", "ArviZ", "reference"]
    for line in densities:  # each curve is a density: it integrates to about 1
        x, y = line.get_xdata(), line.get_ydata()
        assert np.sum(np.diff(x) * 0.5 * (y[1:] + y[:-1])) == pytest.approx(1.0, abs=0.02)
    # the mean tick of the reference sits at its sample mean
    ticks = [line for line in visible[3].lines if line.get_marker() == "|"]
    assert ticks[2].get_xdata()[0] == pytest.approx(reference["b"].mean())


def test_plot_compare_selects_coordinates_and_limits_panels():
    rng = np.random.default_rng(1)
    samples = {"W": rng.normal(size=(300, 2, 3)), "s": rng.normal(size=300)}
    fig = plot_compare({"A": samples, "B": samples}, sites={"W": [0, 5]})
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["W[0,0]", "W[1,2]"]
    fig = plot_compare({"A": samples}, max_panels=3, ncols=2)
    assert [ax.get_title() for ax in fig.axes if ax.get_visible()] == ["W[0,0]", "W[0,1]", "W[0,2]"]


def test_plot_compare_names_a_missing_site():
    with pytest.raises(ValueError, match="'b' is missing from \\['B'\\]"):
        plot_compare({"A": {"b": np.zeros(10)}, "B": {"w": np.zeros(10)}}, sites=["b"])


# ----------------------------------------------------------------------------- plot_clients


def test_plot_clients_shows_q_and_every_cavity(fitted):
    fig = plot_clients(fitted, sites=["w", "b"])
    top = fig.axes[:4]  # the top row (the bottom row holds the precision shares)
    assert [ax.get_title() for ax in top] == ["w[0]", "w[1]", "w[2]", "b"]
    family, q = fitted.config.family, fitted.state.q
    loc, scale = (np.asarray(a) for a in family.loc_scale(q))
    for i, ax in enumerate(top):
        q_line = [line for line in ax.lines if line.get_label() == "q"][0]
        x, y = q_line.get_xdata(), q_line.get_ydata()
        # q's mode is its mean
        assert x[np.argmax(y)] == pytest.approx(loc[i], abs=3 * (x[1] - x[0]))
        assert (
            len([line for line in ax.lines if line.get_label().startswith("without client")]) == 5
        )


def test_plot_clients_precision_shares_sum_to_one(fitted):
    fig = plot_clients(fitted, sites={"w": [1]})
    bars = fig.axes[1].patches
    heights = np.array([b.get_height() for b in bars])
    assert len(heights) == 6  # the prior and 5 clients
    assert heights.sum() == pytest.approx(1.0, abs=1e-5)
    # iid clients of equal size hold similar shares, and together far more than the N(0, 1) prior
    assert heights[0] < 0.05
    assert np.all(heights[1:] > 0.1)


def test_plot_clients_full_rank_and_a_constrained_site(linear_data):
    X, y = linear_data
    inference = pvi.PVI(
        scale_model,
        pvi.FullRankGaussian(),
        [np.arange(100), np.arange(100, 300)],
        update(100),
        pvi.Sequential(),
    )
    result = inference.run(random.PRNGKey(0), 1, X, y=y, progress_bar=False)
    fig = plot_clients(result, max_coords=10)
    assert [ax.get_title() for ax in fig.axes[:4]] == [
        "w[0]",
        "w[1]",
        "w[2]",
        "sigma (unconstrained)",
    ]
    # sigma's precision shares
    heights = np.array([b.get_height() for b in fig.axes[4 + 3].patches])
    assert heights.sum() == pytest.approx(1.0, abs=1e-4)


def test_plot_clients_rejects_unknown_sites(fitted):
    with pytest.raises(ValueError, match="'z' is not a global site"):
        plot_clients(fitted, sites=["z"])


def test_plots_do_not_need_a_pyplot_show(fitted, monkeypatch):
    """Every plot returns the Figure it drew, open in pyplot for the caller to show or save, and
    never shows it."""

    def show(*args, **kwargs):
        raise AssertionError("a plot called plt.show()")

    monkeypatch.setattr(plt, "show", show)
    figs = [plot_history(fitted), plot_compare({"PVI": fitted}), plot_clients(fitted)]
    assert all(isinstance(f, Figure) for f in figs)
    # each is pyplot's, and nothing else is
    assert sorted(plt.get_fignums()) == sorted(f.number for f in figs)
    # and each holds the run's numbers, as with explicit arguments above: the ELBO per round, a
    # density per global coordinate (titled, integrating to about 1), q's mean at each coordinate's
    # mode
    np.testing.assert_allclose(figs[0].axes[0].lines[0].get_ydata(), fitted.history.elbo)
    titles = ["w[0]", "w[1]", "w[2]", "b"]
    visible = [ax for ax in figs[1].axes if ax.get_visible()]
    assert [ax.get_title() for ax in visible] == titles
    for ax in visible:
        x, y = next(line for line in ax.lines if line.get_label() == "PVI").get_data()
        assert np.sum(np.diff(x) * 0.5 * (y[1:] + y[:-1])) == pytest.approx(1.0, abs=0.02)
    assert [ax.get_title() for ax in figs[2].axes[:4]] == titles
    loc = np.asarray(fitted.config.family.loc_scale(fitted.state.q)[0])
    for i, ax in enumerate(figs[2].axes[:4]):
        x, y = next(line for line in ax.lines if line.get_label() == "q").get_data()
        assert x[np.argmax(y)] == pytest.approx(loc[i], abs=3 * (x[1] - x[0]))
