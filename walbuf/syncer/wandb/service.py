"""wandb's service in this process: its upload process (wandb-core) told from its end, renewed, restarted, stopped."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import UploadError
from .failures import describe


@contextlib.contextmanager
def core_connection(doing: str) -> Iterator[None]:
    """Turn wandb-core's end (its connection lost: killed, out of memory) into UploadError.

    wandb's Python side talks to nothing but wandb-core, its upload
    process, so a connection error out of a wandb call is that process gone;
    wandb raises it raw (ConnectionResetError: "Connection lost"), or, to a
    call waiting for a reply, as HandleAbandonedError, or to a call after
    wandb noticed, as MailboxClosedError.
    """
    # A reply that cannot come, or a request that cannot go: the connection is gone.
    import wandb
    from wandb.sdk.mailbox import HandleAbandonedError, MailboxClosedError

    try:
        yield
    except (ConnectionError, HandleAbandonedError, MailboxClosedError) as exc:
        # wandb's exit hook would tell the gone process goodbye and print the
        # ConnectionResetError that gets; its teardown, done here, unhooks it.
        teardown(wandb)
        raise UploadError(
            f"wandb-core, the process wandb uploads through, ended while {doing} ({describe(exc)}): it was"
            " killed or ran out of memory; nothing was marked synced; retry later"
        ) from exc


def renew_wandb() -> None:
    """Between uploads: end wandb's service in this process, gracefully; the next upload starts one afresh.

    wandb-core keeps memory for each run it served (see walbuf.syncer.follow.RENEW_EVERY).
    """
    import wandb

    teardown(wandb)


def restart_wandb() -> None:
    """End wandb's service in this process, so that the next upload starts one afresh.

    After a failed upload wandb's service may still hold the run (the next
    wandb.init of its id fails: "run ID ... is in use") and still retry what
    it was sending. Its wandb-core is killed (nothing more is sent of the
    failed upload, none of which is marked synced) and wandb's side torn down.
    """
    import wandb

    kill_wandb_core()
    teardown(wandb)


def teardown(wandb: Any) -> None:
    """wandb.teardown() of a service whose wandb-core is gone.

    Telling it goodbye loses the connection, and wandb turns the dead
    process's exit status into sys.exit() (wandb_setup._teardown): neither
    is this process's to end with.
    """
    with contextlib.suppress(ConnectionError, SystemExit):
        wandb.teardown()


def kill_wandb_core() -> None:
    """SIGKILL the wandb-core processes this process started (Linux; elsewhere nothing), so that nothing more is
    sent."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    if not tasks.is_dir():
        return
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):  # a thread or child that ended meanwhile
            for child in (task / "children").read_text().split():
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                # wandb-core as the program, or as the file a script's interpreter runs.
                if any(arg.endswith(b"wandb-core") for arg in argv[:2]):
                    os.kill(int(child), signal.SIGKILL)


def own_service_only() -> None:
    """Never join a wandb service that another process started.

    A wandb-using process passes its service down to its children in
    WANDB_SERVICE (its token names the process that started it). A sync
    that joined a parent's service and was then killed would leave its run
    open in that service, and every later sync of the run would fail with
    "run ID is in use". So a sync in a process that did not start the
    service named there forgets it, and wandb starts one of its own. (In
    a process that already uses wandb itself, wandb keeps the service it
    has; this only matters for one that has not.)
    """
    token = os.environ.get("WANDB_SERVICE")
    if token is None:
        return
    parts = token.split("-")
    if len(parts) < 2 or parts[1] != str(os.getpid()):
        del os.environ["WANDB_SERVICE"]


def stop_uploads() -> None:
    """Stop at once everything wandb is uploading for this process (its time is up); nothing more is sent."""
    kill_wandb_core()
