"""The ``Family`` protocol: both families implement it, as siblings; its maps are consistent with
each other and with NumPyro's distributions; on a diagonal Gaussian the mean-field family agrees
with the full-rank one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

import numpyro_pvi as pvi
from numpyro_pvi.families import Family, NatParams, expected_site

MEAN_FIELD, FULL_RANK = pvi.MeanFieldGaussian(), pvi.FullRankGaussian()
FAMILIES = [MEAN_FIELD, FULL_RANK]
DIM = 4


def random_dense(key, dim=DIM):
    """A random mean and a well-conditioned covariance matrix."""
    k1, k2 = jax.random.split(key)
    A = jax.random.normal(k2, (dim, dim))
    return jax.random.normal(k1, (dim,)), A @ A.T / dim + jnp.eye(dim)


def random_nat(family, key):
    """A random member of the family: the moment-matching projection of a random dense Gaussian."""
    mean, cov = random_dense(key)
    return family.from_moments(mean, family.from_dense(cov))


def random_loc_scale(family, key):
    return family.loc_scale(random_nat(family, key))


def test_both_families_implement_the_protocol_as_siblings():
    assert isinstance(MEAN_FIELD, Family) and isinstance(FULL_RANK, Family)
    assert not isinstance(FULL_RANK, pvi.MeanFieldGaussian) and not isinstance(
        MEAN_FIELD, pvi.FullRankGaussian
    )
    assert not issubclass(pvi.FullRankGaussian, pvi.MeanFieldGaussian)
    assert not issubclass(pvi.MeanFieldGaussian, pvi.FullRankGaussian)
    assert not isinstance(object(), Family)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_natural_parameters_round_trip(family):
    with enable_x64(True):
        loc, scale = random_loc_scale(family, jax.random.PRNGKey(0))
        nat = family.from_loc_scale(loc, scale)
        loc2, scale2 = family.loc_scale(nat)
        np.testing.assert_allclose(loc2, loc, rtol=1e-10)
        np.testing.assert_allclose(scale2, scale, rtol=1e-10)
        d = family.to_dist(nat)
        np.testing.assert_allclose(d.mean, loc, rtol=1e-10)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_natural_moments_and_loc_scale_round_trip(family):
    """natural -> moments -> natural, moments -> loc/scale -> moments, and the moments are the
    distribution's."""
    with enable_x64(True):
        nat = random_nat(family, jax.random.PRNGKey(1))
        mean, cov = family.moments(nat)
        again = family.from_moments(mean, cov)
        np.testing.assert_allclose(again.eta1, nat.eta1, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(again.eta2, nat.eta2, rtol=1e-10, atol=1e-12)
        loc, scale = family.loc_scale(nat)
        np.testing.assert_allclose(
            family.moments(family.from_loc_scale(loc, scale))[1], cov, rtol=1e-10
        )
        d = family.to_dist(nat)
        np.testing.assert_allclose(d.mean, mean, rtol=1e-10)
        np.testing.assert_allclose(
            family.to_dense(cov),
            d.covariance_matrix if cov.ndim == 2 else jnp.diag(d.variance),
            rtol=1e-10,
        )
        np.testing.assert_allclose(
            family.dense_precision(nat), jnp.linalg.inv(family.to_dense(cov)), rtol=1e-8
        )
        # the precision in the family's form, and back
        again = family.from_mean_precision(mean, family.precision(nat))
        np.testing.assert_allclose(again.eta1, nat.eta1, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_marginals_agree_with_the_distribution(family):
    with enable_x64(True):
        nat = random_nat(family, jax.random.PRNGKey(2))
        d = family.to_dist(nat)
        marginals = family.marginals(nat)
        assert all(isinstance(x, np.ndarray) and x.dtype == np.float64 for x in marginals)
        np.testing.assert_allclose(marginals.mean, d.mean, rtol=1e-10)
        np.testing.assert_allclose(marginals.variance, d.variance, rtol=1e-10)
        np.testing.assert_allclose(
            marginals.precision, np.diagonal(family.dense_precision(nat)), rtol=1e-12
        )
        improper = family.marginals(nat - 2.0 * nat)  # negative definite precision
        assert np.isnan(improper.mean).all() and np.isnan(improper.variance).all()
        np.testing.assert_allclose(improper.precision, -marginals.precision, rtol=1e-12)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_quadratic_is_the_log_density_up_to_a_constant(family):
    with enable_x64(True):
        nat = random_nat(family, jax.random.PRNGKey(3))
        zeta = jax.random.normal(jax.random.PRNGKey(4), (6, DIM))
        gap = jax.vmap(family.to_dist(nat).log_prob)(zeta) - jax.vmap(
            lambda z: family.quadratic(nat, z)
        )(zeta)
        np.testing.assert_allclose(gap, gap[0], rtol=1e-10)
        # improper natural parameters are fine: the quadratic is linear in them
        both = family.quadratic(nat - 2.0 * nat, zeta[0])
        assert float(both) == pytest.approx(-float(family.quadratic(nat, zeta[0])), rel=1e-12)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_whitening_round_trips(family):
    with enable_x64(True):
        loc, scale = random_loc_scale(family, jax.random.PRNGKey(5))
        u = jax.random.normal(jax.random.PRNGKey(6), (5, DIM))
        zeta = family.unwhiten(loc, scale, u)
        np.testing.assert_allclose(family.whiten(loc, scale, zeta), u, rtol=1e-10, atol=1e-12)
        # N(0, I) in u is N(loc, L L^T) in zeta
        standard = family.whitened_to_nat(loc, scale, jnp.zeros(DIM), family.identity(DIM))
        target = family.from_loc_scale(loc, scale)
        np.testing.assert_allclose(standard.eta1, target.eta1, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(standard.eta2, target.eta2, rtol=1e-10, atol=1e-12)
        other = random_nat(family, jax.random.PRNGKey(7))
        mean, cov = family.nat_to_whitened(loc, scale, other)
        back = family.whitened_to_nat(loc, scale, mean, cov)
        np.testing.assert_allclose(back.eta2, other.eta2, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_mixture_moments(family):
    """SNEP's step mixes members in mean parameters (its Gaussian estimator's, whitened by a third
    member): the member with the convex combination of two members' mean parameters has the moments
    of (1 - w) N(a) + w N(b)."""
    with enable_x64(True):
        a, b = (random_nat(family, jax.random.PRNGKey(k)) for k in (8, 9))
        (ma, ca), (mb, cb) = family.moments(a), family.moments(b)
        chains = family.chain_moments(control_variates=True, site_variance=None)
        frame = family.chain_frame(random_nat(family, jax.random.PRNGKey(10)))
        mixed = chains.mean_params(frame, a) * 0.75 + chains.mean_params(frame, b) * 0.25
        member, valid = chains.from_mean_params(frame, mixed, a)
        mean, cov = family.moments(member)
        assert bool(valid)
        np.testing.assert_allclose(mean, 0.75 * ma + 0.25 * mb, rtol=1e-10)
        second = 0.75 * (family.to_dense(ca) + jnp.outer(ma, ma)) + 0.25 * (
            family.to_dense(cb) + jnp.outer(mb, mb)
        )
        np.testing.assert_allclose(
            family.to_dense(cov),
            family.to_dense(family.from_dense(second - jnp.outer(mean, mean))),
            rtol=1e-10,
            atol=1e-12,
        )
        assert float(family.min_eig(cov)) > 0


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_product_and_quotient_are_sums_of_natural_parameters(family):
    with enable_x64(True):
        a = random_nat(family, jax.random.PRNGKey(1))
        b = random_nat(family, jax.random.PRNGKey(2))
        zeta = jnp.linspace(-1.0, 1.0, 4)
        # log N(z; a) + log N(z; b) - log N(z; a*b) is constant in z
        log_pdf = lambda nat, z: family.to_dist(nat).log_prob(z)  # noqa: E731
        gap = lambda z: log_pdf(a, z) + log_pdf(b, z) - log_pdf(a + b, z)  # noqa: E731
        assert float(gap(zeta)) == pytest.approx(float(gap(-2 * zeta)), rel=1e-10)
        cavity = (a + b) - b
        np.testing.assert_allclose(cavity.eta1, a.eta1, rtol=1e-10)
        np.testing.assert_allclose((0.5 * a).eta2, a.eta2 / 2)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_validity_detects_non_positive_definite(family):
    q = random_nat(family, jax.random.PRNGKey(3))
    assert bool(family.is_valid(q))
    assert not bool(family.is_valid(q - 2.0 * q))
    assert not bool(family.is_valid(q._replace(eta1=q.eta1.at[0].set(jnp.nan))))


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_site_update_of_a_gaussian_log_density_is_that_gaussian(family):
    """grad_mu E_q[log N(z; m, P^-1)] are the natural parameters of N(m, P^-1), whatever q is."""
    with enable_x64(True):
        target = random_nat(family, jax.random.PRNGKey(4))
        loc, scale = random_loc_scale(family, jax.random.PRNGKey(5))
        half = jax.random.normal(jax.random.PRNGKey(6), (20000, DIM))
        eps = jnp.concatenate([half, -half])

        @jax.jit  # one program (eagerly, each of its operations compiles one of its own)
        def sites(target, loc, scale, eps):
            log_prob = family.to_dist(target).log_prob
            grads = jax.vmap(jax.grad(log_prob))(family.unwhiten(loc, scale, eps))
            hess = family.stein_hessian(grads, eps, scale)
            got = family.site_update(grads.mean(0), hess, loc)
            # with the Hessian itself, antithetic pairs make it exact
            q = family.from_loc_scale(loc, scale)
            exact = expected_site(
                family,
                q,
                eps[::1000],
                jax.vmap(jax.grad(log_prob)),
                jax.vmap(jax.hessian(log_prob)),
            )
            return got, exact

        got, exact = sites(target, loc, scale, eps)
        # MC: ~1/sqrt(4e4)
        np.testing.assert_allclose(got.eta2, target.eta2, atol=0.05 * np.abs(target.eta2).max())
        np.testing.assert_allclose(got.eta1, target.eta1, atol=0.05 * np.abs(target.eta1).max())
        np.testing.assert_allclose(exact.eta2, target.eta2, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(exact.eta1, target.eta1, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("family", FAMILIES, ids=type)
def test_clamp_precision_clips_eigenvalues(family):
    with enable_x64(True):
        nat = random_nat(family, jax.random.PRNGKey(10))
        eigenvalues = np.linalg.eigvalsh(family.dense_precision(nat))
        low, high = float(eigenvalues[1]), float(eigenvalues[-2])
        clamped, acted = family.clamp_precision(nat, low, high)
        new = np.linalg.eigvalsh(family.dense_precision(clamped))
        assert bool(acted) and new.min() >= low * (1 - 1e-9) and new.max() <= high * (1 + 1e-9)
        same, acted = family.clamp_precision(nat, 0.5 * eigenvalues[0], 2.0 * eigenvalues[-1])
        assert not bool(acted)
        np.testing.assert_allclose(same.eta2, nat.eta2, rtol=1e-10)


def test_mean_field_agrees_with_full_rank_on_a_diagonal_gaussian():
    """Every map of the mean-field family is the full-rank family's, restricted to diagonal
    matrices."""
    with enable_x64(True):
        mean, var = jnp.array([0.5, -1.0, 2.0, 0.0]), jnp.array([0.5, 2.0, 1.5, 3.0])
        mf, fr = MEAN_FIELD.from_moments(mean, var), FULL_RANK.from_moments(mean, jnp.diag(var))
        dense = MEAN_FIELD.to_dense
        close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)  # noqa: E731
        close(mf.eta1, fr.eta1)
        close(dense(MEAN_FIELD.precision(mf)), FULL_RANK.precision(fr))
        close(MEAN_FIELD.dense_precision(mf), FULL_RANK.dense_precision(fr))
        close(MEAN_FIELD.to_dense(MEAN_FIELD.moments(mf)[1]), FULL_RANK.moments(fr)[1])
        for a, b in zip(MEAN_FIELD.marginals(mf), FULL_RANK.marginals(fr)):
            close(a, b)
        zeta = jnp.array([1.0, 0.3, -0.7, 2.0])
        close(MEAN_FIELD.quadratic(mf, zeta), FULL_RANK.quadratic(fr, zeta))
        close(MEAN_FIELD.to_dist(mf).log_prob(zeta), FULL_RANK.to_dist(fr).log_prob(zeta))
        (loc, sd), (_, tril) = MEAN_FIELD.loc_scale(mf), FULL_RANK.loc_scale(fr)
        close(jnp.diag(sd), tril)
        u = jax.random.normal(jax.random.PRNGKey(0), (3, DIM))
        close(MEAN_FIELD.unwhiten(loc, sd, u), FULL_RANK.unwhiten(loc, tril, u))
        close(MEAN_FIELD.whiten(loc, sd, zeta), FULL_RANK.whiten(loc, tril, zeta))
        white_mf, white_fr = (
            MEAN_FIELD.nat_to_whitened(loc, sd, mf),
            FULL_RANK.nat_to_whitened(loc, tril, fr),
        )
        close(white_mf[0], white_fr[0])
        close(dense(white_mf[1]), white_fr[1])
        close(
            MEAN_FIELD.whitened_to_nat(loc, sd, u[0], var).eta2,
            jnp.diagonal(FULL_RANK.whitened_to_nat(loc, tril, u[0], jnp.diag(var)).eta2),
        )
        # a diagonal dense precision projects to itself
        close(MEAN_FIELD.from_dense_precision(mean, jnp.diag(1.0 / var)).eta2, mf.eta2)
        close(FULL_RANK.from_dense_precision(mean, jnp.diag(1.0 / var)).eta2, fr.eta2)
        # the forms' algebra
        a, b = u[1], u[2]
        close(dense(MEAN_FIELD.outer(a, b)), jnp.diag(jnp.diagonal(FULL_RANK.outer(a, b))))
        close(MEAN_FIELD.outer_sum(u, u), jnp.diagonal(FULL_RANK.outer_sum(u, u)))
        close(MEAN_FIELD.matvec(var, u), FULL_RANK.matvec(jnp.diag(var), u))
        close(MEAN_FIELD.min_eig(var), FULL_RANK.min_eig(jnp.diag(var)))
        close(dense(MEAN_FIELD.identity(DIM)), FULL_RANK.identity(DIM))
        close(dense(MEAN_FIELD.sym(var)), FULL_RANK.sym(jnp.diag(var)))
        # sites: Stein's Hessian of a diagonal quadratic, the CVI site, the clamp
        grads = -(u - mean) / var
        close(
            dense(MEAN_FIELD.stein_hessian(grads, u, sd)),
            FULL_RANK.stein_hessian(grads, u, tril) * jnp.eye(DIM),
        )
        hess = -1.0 / var
        close(
            MEAN_FIELD.site_update(grads.mean(0), hess, loc).eta1,
            FULL_RANK.site_update(grads.mean(0), jnp.diag(hess), loc).eta1,
        )
        clamped_mf, acted_mf = MEAN_FIELD.clamp_precision(mf, 0.4, 1.0)
        clamped_fr, acted_fr = FULL_RANK.clamp_precision(fr, 0.4, 1.0)
        assert bool(acted_mf) and bool(acted_fr)
        close(dense(clamped_mf.eta2), clamped_fr.eta2)


def test_with_block_embeds_prior_blocks():
    diag = MEAN_FIELD.with_block(jnp.zeros(4), slice(1, 3), jnp.array([2.0, 3.0]))
    np.testing.assert_allclose(diag, [0.0, 2.0, 3.0, 0.0])
    # a full block is not mean-field
    assert MEAN_FIELD.with_block(jnp.zeros(4), slice(1, 3), jnp.eye(2)) is None
    full = FULL_RANK.with_block(jnp.zeros((4, 4)), slice(1, 3), jnp.array([2.0, 3.0]))
    np.testing.assert_allclose(full, jnp.diag(diag))
    block = jnp.array([[2.0, 0.5], [0.5, 1.0]])
    full = FULL_RANK.with_block(jnp.zeros((4, 4)), slice(2, 4), block)
    np.testing.assert_allclose(full[2:, 2:], block)
    assert float(jnp.abs(full[:2]).sum()) == 0.0


def test_zeros_is_the_flat_factor():
    for family in FAMILIES:
        t = family.zeros(DIM)
        q = random_nat(family, jax.random.PRNGKey(0))
        assert isinstance(t, NatParams)
        np.testing.assert_allclose((q + t).eta2, q.eta2)
        assert family.to_dense(family.precision(t)).shape == (DIM, DIM)


# ---------------------------------------------------------------------- the FactorFamily members


@pytest.mark.parametrize("family", FAMILIES, ids=["mean_field", "full_rank"])
def test_guide_round_trip_and_antithetic_draws(family):
    nat = random_nat(family, jax.random.PRNGKey(11))
    values = {
        "_p_loc": family.guide_params(nat)[0],
        "_p_" + family.scale_name: family.guide_params(nat)[1],
    }
    for a, b in zip(jax.tree.leaves(family.from_guide("_p_", values)), jax.tree.leaves(nat)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    zeta = family.draw(nat, jax.random.PRNGKey(1), 8)
    # pairs z, 2 mu - z
    np.testing.assert_allclose(zeta.mean(0), family.loc_scale(nat)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES, ids=["mean_field", "full_rank"])
def test_site_from_draws_is_expected_site_and_match_moments_control_variate(family):
    """site_from_draws is the Bonnet / Price site at the family's own draws; match_moments with
    uniform weights returns the proposal itself, and with weights it is the weighted moments
    (checked in float64)."""
    with enable_x64():
        nat = jax.tree.map(
            lambda x: x.astype(jnp.float64), random_nat(family, jax.random.PRNGKey(12))
        )
        f = lambda z: -0.5 * jnp.sum((z - 1.0) ** 2 / jnp.arange(1.0, DIM + 1))  # noqa: E731
        zeta = family.draw(nat, jax.random.PRNGKey(2), 16)
        weights = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (zeta.shape[0],)))

        @jax.jit  # one program (eagerly, each of its operations compiles one of its own)
        def sites(nat, zeta, weights):
            site = family.site_from_draws(
                nat,
                zeta,
                jax.vmap(f)(zeta),
                jax.vmap(jax.grad(f))(zeta),
                jax.vmap(jax.hessian(f))(zeta),
            )
            uniform = jnp.full(zeta.shape[0], 1.0 / zeta.shape[0])
            matched = family.moments(family.match_moments(nat, zeta, weights))
            return site, family.match_moments(nat, zeta, uniform), matched

        site, same, (mean, cov) = sites(nat, zeta, weights)
        np.testing.assert_allclose(site.eta1, 1.0 / jnp.arange(1.0, DIM + 1), rtol=1e-8)
        for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(nat)):
            np.testing.assert_allclose(a, b, rtol=1e-8, atol=1e-10)
        loc = family.loc_scale(nat)[0]
        d = zeta - loc
        expected_mean = loc + (weights - 1.0 / zeta.shape[0]) @ d
        np.testing.assert_allclose(mean, expected_mean, rtol=1e-8, atol=1e-10)


def test_site_families_lay_out_blocks_and_map_over_them():
    """Blocks in order of first appearance (default block for the rest), identity transforms for an
    exponential family's sites; the product distribution's log density and KL are the blocks'
    sums."""
    import numpyro
    import numpyro.distributions as dist

    from numpyro_pvi.families.block_distribution import BlockDistribution
    from numpyro_pvi.model.sites import read_model

    def model(y=None):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        tau = numpyro.sample("tau", dist.Gamma(2.0, 1.0))
        with pvi.partition_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(a + w.sum(), 1.0 / jnp.sqrt(tau)), obs=y)

    family = pvi.SiteFamilies({"w": pvi.FullRankGaussian(), "tau": pvi.Gamma()})
    family, sites = family.lay_out(read_model(model, (), {"y": jnp.zeros(3)}))
    assert [s.name for s in sites.globals] == ["a", "w", "tau"] and sites.dim == 4
    assert [(a, b) for _, a, b, _ in family.blocks] == [(0, 1), (1, 3), (3, 4)]
    # its own value, no exp
    assert float(sites.unflatten(jnp.array([0.0, 0.0, 0.0, 2.5]))["tau"]) == 2.5
    q = family.join(
        [
            MEAN_FIELD.from_loc_scale(jnp.zeros(1), jnp.ones(1)),
            FULL_RANK.from_loc_scale(jnp.ones(2), jnp.eye(2)),
            pvi.Gamma().from_params(jnp.array([3.0]), jnp.array([2.0])),
        ]
    )
    p = (
        q * 0.5
        + family.join(
            [
                MEAN_FIELD.zeros(1),
                FULL_RANK.zeros(2),
                pvi.Gamma().from_params(jnp.array([1.0]), jnp.array([0.5])),
            ]
        )
        * 0.5
    )
    assert bool(family.is_valid(q)) and not bool(family.is_valid(q - q))
    value = jnp.array([0.3, 1.0, 2.0, 1.5])

    def blocks(nat):
        return [
            MEAN_FIELD.to_dist(family.split(nat)[0]),
            FULL_RANK.to_dist(family.split(nat)[1]),
            pvi.Gamma().to_dist(family.split(nat)[2]),
        ]

    @jax.jit  # one program (eagerly, each of its operations compiles one of its own)
    def densities(q, p, value):
        parts, parts_p = blocks(q), blocks(p)
        expected = sum(d.log_prob(v) for d, v in zip(parts, [value[:1], value[1:3], value[3:]]))
        return (
            family.to_dist(q).log_prob(value),
            expected,
            dist.kl_divergence(family.to_dist(q), family.to_dist(p)),
            sum(dist.kl_divergence(a, b) for a, b in zip(parts, parts_p)),
        )

    log_prob, expected, kl, kl_parts = densities(q, p, value)
    np.testing.assert_allclose(log_prob, expected, rtol=1e-6)
    np.testing.assert_allclose(kl, kl_parts, rtol=1e-6)
    assert isinstance(family.to_dist(q), BlockDistribution) and family.to_dist(q).has_rsample
    marg = family.marginals(q)
    np.testing.assert_allclose(marg.mean, [0.0, 1.0, 1.0, 1.5], rtol=1e-6)
    with pytest.raises(ValueError, match="not global latent sites"):
        pvi.SiteFamilies({"nope": pvi.Gamma()}).lay_out(sites)
