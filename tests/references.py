"""NUTS, SVI and VI references of the tests, written by ``python
benchmarks/make_test_references.py`` (do not edit); each constant's comment says how it was
computed.

NUTS: the mean and sd over 4 chains (keys 0-3) of 1000 warmup + 10000 draws (float32, as the tests),
in PVI's flat unconstrained space; ESS is the smallest over coordinates (the means' MC error is sd /
sqrt(ESS)).
"""

import numpy as np

# scale_model on make_linear_data(): (w[0], w[1], w[2], log sigma)
SCALE_MODEL_MEAN = np.array([1.061444, -0.5004033, 0.2952116, -0.6520998])
SCALE_MODEL_SD = np.array([0.03172265, 0.0312647, 0.02929558, 0.04123067])
SCALE_MODEL_ESS = 45938

# robust_model (Cauchy noise) on make_heavy_tailed_data(): (w[0], w[1])
ROBUST_MODEL_MEAN = np.array([0.9818341, -0.5341743])
ROBUST_MODEL_SD = np.array([0.02820927, 0.02703859])
ROBUST_MODEL_ESS = 23887

# NumPyro SVI on logistic_model and make_logistic_data() (TraceMeanField_ELBO(8), Adam 2e-2 decayed
# to 2 % over 6,000 steps, key 0), in PVI's flat order (w[0], w[1], w[2], b):
# AutoDiagonalNormal's and AutoMultivariateNormal's mean and covariance
SVI_LOGISTIC_MEAN_FIELD_MEAN = np.array([1.324314, -0.8313881, 0.5563313, -0.2932744])
SVI_LOGISTIC_MEAN_FIELD_COV = np.array(
    [[0.01986488, 0, 0, 0], [0, 0.01808148, 0, 0], [0, 0, 0.0161175, 0], [0, 0, 0, 0.01494538]]
)
SVI_LOGISTIC_FULL_RANK_MEAN = np.array([1.326553, -0.8327584, 0.5567283, -0.2936049])
SVI_LOGISTIC_FULL_RANK_COV = np.array(
    [
        [0.02283649, -0.006526517, 0.004460999, -0.001176794],
        [-0.006526517, 0.02005346, -0.002725639, 0.0003827429],
        [0.004460999, -0.002725639, 0.01713043, -0.0009850328],
        [-0.001176794, 0.0003827429, -0.0009850328, 0.01499339],
    ]
)

# online VI by hand on make_logistic_data()'s rows 0-99, 100-249, 250-399 (AutoNormal, 4,000 steps
# per task, keys 10, 11, 12): the final (w[0], w[1], w[2], b) means and sds
ONLINE_VI_LOGISTIC_LOC = np.array([1.381078, -0.8493109, 0.5065426, -0.2901949])
ONLINE_VI_LOGISTIC_SCALE = np.array([0.142215, 0.134693, 0.1329477, 0.1262422])

# global mean-field VI's optimum on sklearn's breast cancer data, standardised (30 weights, then the
# intercept): 64-point Gauss-Hermite expectations, BFGS in float64 (deterministic)
BREAST_CANCER_MEAN_FIELD_VI_MEAN = np.array(
    [
        -0.5530524,
        -0.5106677,
        -0.5383213,
        -0.6269329,
        -0.2963721,
        0.5661349,
        -1.015112,
        -1.127319,
        0.1228525,
        0.5092249,
        -1.532489,
        0.3407963,
        -0.8746124,
        -1.274976,
        -0.4534043,
        0.7232293,
        0.4449721,
        -0.3894188,
        0.2914707,
        0.8674675,
        -1.202867,
        -1.585322,
        -0.9850267,
        -1.189021,
        -0.7799391,
        -0.1081538,
        -1.045082,
        -1.11001,
        -1.136307,
        -0.5766735,
        0.2171769,
    ]
)
BREAST_CANCER_MEAN_FIELD_VI_SD = np.array(
    [
        0.5492916,
        0.2931002,
        0.5702904,
        0.5870056,
        0.3328639,
        0.3933963,
        0.4596098,
        0.551133,
        0.3288253,
        0.3232701,
        0.4810807,
        0.3095824,
        0.4986418,
        0.619103,
        0.2778227,
        0.3058633,
        0.296547,
        0.3451824,
        0.3170955,
        0.3489955,
        0.6371517,
        0.2943574,
        0.6500117,
        0.6588652,
        0.3192189,
        0.3454275,
        0.3780744,
        0.4906048,
        0.2892836,
        0.3093216,
        0.2907634,
    ]
)

# NumPyro SVI on intercept_model and make_intercept_data() (AutoNormal, TraceMeanField_ELBO(8), Adam
# 2e-2 decayed to 2 % over 6,000 steps, key 0): its parameters (b, w scalars; u per group)
INTERCEPT_SVI_AUTONORMAL = {
    "b_auto_loc": np.array([0.6599645])[0],
    "b_auto_scale": np.array([0.1417244])[0],
    "u_auto_loc": np.array(
        [
            0.03245834,
            -0.2891962,
            0.1047378,
            0.1103309,
            0.3393607,
            -0.6721634,
            0.852522,
            1.034265,
            -0.7819102,
            0.2986743,
            -0.7279233,
            -0.1590274,
        ]
    ),
    "u_auto_scale": np.array(
        [
            0.4527217,
            0.4452369,
            0.4459676,
            0.443474,
            0.4517272,
            0.4467015,
            0.4516566,
            0.4478201,
            0.4519882,
            0.4454988,
            0.4454614,
            0.4448829,
        ]
    ),
    "w_auto_loc": np.array([1.402598])[0],
    "w_auto_scale": np.array([0.1445756])[0],
}

# logistic_model on make_skewed_logistic_data(), (w[0], w[1], b): NUTS (one chain, 500 warmup +
# 10,000 draws, key 0) and global VI (AutoMultivariateNormal, Trace_ELBO(8), Adam 1e-2 decayed to
# 5 % over 4,000 steps, key 1), each a mean and a covariance
SKEWED_LOGISTIC_NUTS_MEAN = np.array([2.174667, -1.519379, 0.311054])
SKEWED_LOGISTIC_NUTS_COV = np.array(
    [
        [0.2409376, -0.07477685, 0.03067932],
        [-0.07477685, 0.1828822, -0.009075978],
        [0.03067932, -0.009075978, 0.1205573],
    ]
)
SKEWED_LOGISTIC_VI_MEAN = np.array([2.159937, -1.513924, 0.3082316])
SKEWED_LOGISTIC_VI_COV = np.array(
    [
        [0.2384943, -0.07344916, 0.03847554],
        [-0.07344916, 0.1819381, -0.01281203],
        [0.03847554, -0.01281203, 0.1244973],
    ]
)

# NUTS on make_nb_data() (one chain, 500 warmup + 500 draws, key 0): the mean and sd of
# (b, w[0..2], log phi) for nb_model and of (b, w[0..2]) for nb_fixed_model
NB_MODEL_NUTS_MEAN = np.array([1.998685, 0.5007548, -0.29739, 0.2075853, 0.775524])
NB_MODEL_NUTS_SD = np.array([0.01647145, 0.01782737, 0.01722714, 0.01717816, 0.04472822])
NB_FIXED_MODEL_NUTS_MEAN = np.array([1.99765, 0.5019349, -0.2978477, 0.208859])
NB_FIXED_MODEL_NUTS_SD = np.array([0.01754382, 0.01761189, 0.01656095, 0.01598523])
