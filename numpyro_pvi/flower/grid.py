"""A Flower ``Grid`` that collects replies every 0.1 s (flwr 1.42's deployment grid: every 3 s).

Flower's ``Grid.send_and_receive`` in a deployment pushes the messages, pulls once, and then waits 3
s between pulls: a round whose replies come in 0.3 s still takes 3 s. :class:`PollingGrid` wraps a
grid and pulls every ``poll_interval`` seconds; everything else is the wrapped grid's.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

POLL_INTERVAL = 0.1
"""Seconds between the server's pulls for replies."""


class PollingGrid(Grid):
    """``grid``, with ``send_and_receive`` pulling the replies every ``poll_interval`` seconds.

    **Example:** ``strategy.start(PollingGrid(grid), num_rounds=10)`` in a ``ServerApp``'s main
    (:func:`~numpyro_pvi.flower.server_app` does this).
    """

    def __init__(self, grid: Grid, poll_interval: float = POLL_INTERVAL) -> None:
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be positive seconds, got {poll_interval!r}.")
        self.grid, self.poll_interval = grid, poll_interval

    def set_run(self, run: Run) -> None:
        """The wrapped grid's."""
        self.grid.set_run(run)

    @property
    def run(self) -> Run:
        """The wrapped grid's."""
        return self.grid.run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        """The wrapped grid's."""
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The wrapped grid's."""
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """The wrapped grid's."""
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The wrapped grid's."""
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Push ``messages`` and pull their replies every ``poll_interval`` seconds until all have
        come or ``timeout`` seconds have passed (``None``: no limit), as Flower's grids do."""
        waiting = set(self.push_messages(messages))
        end = None if timeout is None else time.time() + timeout
        replies: list[Message] = []
        while waiting:
            got = list(self.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if not waiting or (end is not None and time.time() >= end):
                break
            time.sleep(self.poll_interval)
        return replies
