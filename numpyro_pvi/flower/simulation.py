"""Flower's simulation engine started without the alarms Ray's start and stop raise beside JAX."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

from numpyro_pvi.backends.ray import start_ray


def run_simulation(
    server_app: ServerApp,
    client_app: ClientApp,
    num_supernodes: int,
    backend_config: dict | None = None,
    **kwargs: Any,
) -> Any:
    """``flwr.simulation.run_simulation`` with Ray started by
    :func:`~numpyro_pvi.backends.ray.start_ray`.

    Flower's engine calls ``ray.init`` itself, in a process where JAX's threads already run, so a
    plain run prints "os.fork() was called ... will likely lead to a deadlock" (JAX's fork hook,
    fired when Ray spawns its daemons with a ``preexec_fn``; the children run another program at
    once) and ``ResourceWarning``\\ s for the ``/dev/null`` handles Ray leaves open; at the end
    Ray's shutdown kills its daemons without waiting for them ("subprocess ... is still running").
    None is about PVI's or the caller's state. Here Ray is started first, with
    ``backend_config["init_args"]`` and the ``PYTHONPATH`` Flower would pass, through
    :func:`~numpyro_pvi.backends.ray.start_ray` (which silences the first two during ``ray.init``
    only); Flower then finds Ray running and uses it, and shuts it down at the end as it always
    does, with that last warning silenced for the run's duration only. Every other warning passes.
    If Ray is already running, Flower uses it as it is.

    **Example:** ``run_simulation(server_app(strategy, num_rounds=20), client_app(model, family,
    update, load_data), num_supernodes=4, backend_config={"client_resources": {"num_cpus": 1}})``
    """
    import ray
    from flwr.simulation import run_simulation as flower_run_simulation

    backend_config = {} if backend_config is None else backend_config
    if not ray.is_initialized():
        init_args = {
            "logging_level": "WARNING",
            "log_to_driver": True,  # Flower's defaults
            **{k.replace("-", "_"): v for k, v in backend_config.get("init_args", {}).items()},
        }
        # what Flower's engine does: its workers must see this process's sys.path
        pythonpath = os.pathsep.join([*sys.path, *filter(None, [os.environ.get("PYTHONPATH")])])
        start_ray(
            ray,
            init_args.pop("num_cpus", None),
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
            **init_args,
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"subprocess \d+ is still running", ResourceWarning)
        return flower_run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=num_supernodes,
            backend_config=backend_config,
            **kwargs,
        )
