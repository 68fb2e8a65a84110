"""A Flower SuperNode whose ClientApp stays warm: JAX, the site's data and its compiled update carry
over from one message to the next.

``flower-supernode`` (flwr 1.42) starts a fresh ``flwr-clientapp`` process for every message: each
round, every site imports JAX, NumPyro and this library again, rebuilds its problem and retraces
its update; and it looks for new messages every 3 s. With two sites on one 2-core machine
(``benchmarks/flower_deploy.py``) a round took 12.8 s on a quiet machine, 40-60 s on a busy one
(5-8 s there with this SuperNode).

``python -m numpyro_pvi.flower.supernode`` takes ``flower-supernode``'s arguments and runs the same
SuperNode with two changes:

* its ClientApp runs in a thread of the SuperNode's own process (``--isolation process``, and a
  :class:`Worker` on its runtime API in place of Flower's ``flower-superexec``), so
  :class:`~numpyro_pvi.flower.Site`'s caches (the site's problem, its jitted update) live as long as
  the SuperNode;
* it asks the SuperLink for messages every ``POLL_INTERVAL`` (0.1 s) rather than every 3 s.

    python -m numpyro_pvi.flower.supernode --insecure --superlink 127.0.0.1:8000 --port 9094 \\
        --node-config 'partition-id=0 data-path="/data/site0.npz"'

The ClientApp runs as ``flwr-clientapp`` runs it with runtime dependency installation off: the
app's dependencies must be installed where the SuperNode runs. One app at a time (a new app
version is loaded afresh, its modules imported again). Written against flwr 1.42's SuperNode and
runtime API (the ``flower`` extra pins ``flwr>=1.42,<1.43``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from logging import DEBUG, ERROR, INFO
from pathlib import Path

from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.config import get_project_dir
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest  # pylint: disable=E0611
from flwr.supercore import log
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import (
    pull_task_input,
    push_message,
    push_task_output,
)

POLL_INTERVAL = 0.1
"""Seconds between the SuperNode's requests for messages (``flower-supernode``: 3 s) and the
worker's for a task (``flower-superexec``: 1 s) while there is none."""


class Worker:
    """Runs a SuperNode's ClientApp tasks one after the other in this process: Flower's
    ``flower-superexec`` loop, with ``flwr-clientapp``'s work done here rather than in a new process
    per task.

    :param runtime_api_address: the SuperNode's runtime API, ``host:port`` (its ``--port``).
    :param insecure: connect without TLS (a SuperNode started without ``--ssl-certfile``).
    :param root_certificates: PEM bytes of the CA that signed the runtime API's certificate.
    :param poll_interval: seconds between requests for a task while there is none.

    **Example:** ``Worker("127.0.0.1:9094", insecure=True).serve()`` beside ``flower-supernode
    --isolation process --port 9094 ...`` (what :func:`main` runs in a thread)
    """

    def __init__(
        self,
        runtime_api_address: str,
        insecure: bool = False,
        root_certificates: bytes | None = None,
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be positive seconds, got {poll_interval!r}.")
        self.address, self.insecure = runtime_api_address, insecure
        self.root_certificates, self.poll_interval = root_certificates, poll_interval
        self._fab_hash: str | None = None
        self._app: ClientApp | None = None
        self._app_dir: Path | None = None

    def _client(self, *interceptors: object) -> RuntimeHttpClient:
        return RuntimeHttpClient.from_server_address(
            server_address=self.address,
            insecure=self.insecure,
            root_certificates=self.root_certificates,
            interceptors=list(interceptors),
            retry_invoker=make_simple_http_retry_invoker(),
        )

    def serve(self, max_tasks: int | None = None) -> None:
        """Take the SuperNode's ClientApp tasks and run them, forever (or ``max_tasks`` of
        them)."""
        client = self._client(RuntimeVersionHttpInterceptor(component_name="SuperExec"))
        done = 0
        try:
            while max_tasks is None or done < max_tasks:
                res = client.AcquireTask(
                    AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
                )
                if res.HasField("task") and res.token:
                    self.run_task(res.token)
                    done += 1
                else:
                    time.sleep(self.poll_interval)
        finally:
            client.close()

    def run_task(self, token: str) -> None:
        """One message, as ``flwr-clientapp --token token`` runs it, in this process."""
        client = self._client(
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        )
        heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
        heartbeat.start()
        message = context = reply = None
        status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        start = time.perf_counter()
        try:
            message, context, run, fab = pull_task_input(client)
            app = self._load(run.fab_id, run.fab_version, fab.hash_str, fab.content)
            pulled = time.perf_counter()
            reply = app(message=message, context=context)
            log(
                INFO,
                "ClientApp %s message: %.2f s in the app (%.2f s to fetch it)",
                message.metadata.message_type,
                time.perf_counter() - pulled,
                pulled - start,
            )
            status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # noqa: BLE001 - reported to the server, as flwr-clientapp does
            code = (
                ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                if isinstance(ex, LoadClientAppError)
                else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            )
            log(ERROR, "ClientApp raised an exception", exc_info=ex)
            details = f"{type(ex)}:<'{ex}'>"
            if message is not None:
                reply = Message(Error(code=code, reason=details), reply_to=message)
        finally:
            try:
                if reply is not None and context is not None:
                    push_message(client, reply, context)
            except Exception as ex:  # noqa: BLE001 - the task's status still goes back
                log(ERROR, "Failed to push reply message", exc_info=ex)
            push_task_output(client=client, context=context, sub_status=status, details=details)
            if heartbeat.is_running:
                heartbeat.stop()
            client.close()

    def _load(self, fab_id: str, fab_version: str, fab_hash: str, content: bytes) -> ClientApp:
        """The app's ClientApp, installed and imported once per app version."""
        if fab_hash != self._fab_hash:
            if self._app_dir is not None:  # another version: import its modules afresh
                for name, module in list(sys.modules.items()):
                    file = vars(module).get("__file__")
                    if file is not None and Path(file).is_relative_to(self._app_dir):
                        del sys.modules[name]
            install_from_fab(content, skip_prompt=True)
            self._app_dir = Path(get_project_dir(fab_id, fab_version, fab_hash)).resolve()
            log(INFO, "Loading the ClientApp of %s %s (kept warm)", fab_id, fab_version)
            self._app = get_load_client_app_fn("", None, multi_app=True)(
                fab_id, fab_version, fab_hash
            )
            self._fab_hash = fab_hash
        log(DEBUG, "ClientApp %s %s", fab_id, fab_version)
        return self._app


class _CappedSleep:
    """The ``time`` module as ``flwr.supernode.start_client_internal`` sees it: its waits (3 s for
    a message, 0.5 s for a reply) capped at ``cap`` seconds."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, self.cap))


def main(argv: list[str] | None = None) -> None:
    """``python -m numpyro_pvi.flower.supernode [flower-supernode's arguments]``: the SuperNode with
    its ClientApp warm in this process (see the module docstring).

    **Example:** ``python -m numpyro_pvi.flower.supernode --insecure --superlink 127.0.0.1:8000
    --port 9094 --node-config 'partition-id=0 data-path="site0.npz"'``
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--isolation", default=None)
    known.add_argument("--host", default="127.0.0.1")
    known.add_argument("--port", type=int, default=9094)
    known.add_argument("--ssl-certfile", default=None)
    known.add_argument("--ssl-ca-certfile", default=None)
    known.add_argument("--superexec-auth-secret-file", default=None)
    args, _ = known.parse_known_args(argv)
    if args.isolation not in (None, "process"):
        raise ValueError(
            "numpyro_pvi.flower.supernode runs its ClientApp itself (--isolation process); drop "
            f"--isolation {args.isolation} or use flower-supernode."
        )
    if args.superexec_auth_secret_file is not None:
        raise ValueError(
            "numpyro_pvi.flower.supernode's worker does not sign its requests: drop "
            "--superexec-auth-secret-file or use flower-supernode."
        )
    if args.isolation is None:
        argv += ["--isolation", "process"]
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    host = f"[{host}]" if ":" in host else host
    certificates = None if args.ssl_ca_certfile is None else Path(args.ssl_ca_certfile).read_bytes()
    worker = Worker(f"{host}:{args.port}", args.ssl_certfile is None, certificates)
    import importlib
    import threading

    from flwr.supernode.cli import flower_supernode

    # the module (flwr.supernode exports a function of the same name)
    loop = importlib.import_module("flwr.supernode.start_client_internal")
    # JAX, NumPyro and the library load before the first message
    import numpyro_pvi.flower  # noqa: F401

    def serve() -> None:
        try:
            worker.serve()
        except BaseException as ex:  # noqa: BLE001 - a SuperNode that runs no ClientApp must stop
            log(ERROR, "The ClientApp worker stopped: stopping the SuperNode", exc_info=ex)
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=serve, name="numpyro-pvi-clientapp", daemon=True).start()
    loop.time = _CappedSleep(POLL_INTERVAL)
    sys.argv = ["flower-supernode", *argv]
    flower_supernode()


if __name__ == "__main__":
    main()
