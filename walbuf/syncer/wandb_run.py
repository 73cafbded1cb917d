"""The wandb adapter: the one module that imports wandb, and what the syncer needs of it.

It opens one wandb run (shared mode online, wandb's offline mode otherwise)
with settings for a headless uploader: no console capture, no system metrics,
no code or git snapshot, history posted every 2 s, bounded retries so that
an unreachable server fails the sync instead of hanging it.

wandb's failures are sorted by whether a retry can fix them:

- UploadError ("retry later"): the server unreachable or timing out, a 5xx,
  a 429 that outlasted the retries;
- ConfigError: what will fail the same way every time: missing or refused
  credentials, a setting wandb refuses (a malformed WANDB_BASE_URL, a bad
  run id), any other 4xx (a deleted run's id, no permission, no such
  entity);
- RowRefused: wandb refused one row's data (a key or value it cannot take);
  the syncer quarantines that record and goes on.

Anything else wandb raises is a bug, here or in wandb, and is not caught.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MetricValueError, MissingExtraError, TargetRefusedError, UploadError, WalbufError
from ..histogram import TYPE as HISTOGRAM
from ..image import TYPE as IMAGE
from ..image import png_of
from ..store import Target
from .results import SyncMode

FILE_STREAM_INTERVAL = 2.0  # seconds between wandb-core's history posts (whole seconds: wandb-core truncates)


class WandbRun:
    """One upload into the W&B run ``target`` (the syncer's only view of wandb).

    wandb writes its files (the run folder, its logs) under ``directory``:
    the offline run directory, or a working folder the syncer removes.
    """

    def __init__(
        self,
        target: Target,
        name: str | None,
        mode: SyncMode,
        directory: Path,
        *,
        config: dict[str, Any] | None = None,
        init_timeout: float = 90.0,
        finish_state: bool = False,
    ) -> None:
        import wandb

        _own_service_only()
        self.mode = mode
        shared = mode == "online"
        settings = wandb.Settings(
            mode="shared" if shared else "offline",
            # Not the run's primary writer: this host's metadata, requirements
            # and config files are not the job's. And the run's state is the
            # job's: a sync leaves it alone unless it is to finish the run
            # (walbuf.syncer.finish). W&B docs, "distributed training".
            x_primary=not shared,
            x_update_finish_state=finish_state or not shared,
            x_label=f"walbuf-sync-{socket.gethostname()}-{os.getpid()}",
            console="off",
            x_disable_stats=True,
            x_disable_machine_info=True,
            x_save_requirements=False,  # the syncer's packages, not the job's (and listing them takes 0.1-0.2 s)
            save_code=False,
            disable_git=True,
            disable_job_creation=True,
            silent=True,
            init_timeout=init_timeout,
            # History goes out every 2 s, not every 15 s (wandb's default): with
            # a long backlog, wandb-core's work per row grows with the rows
            # waiting for the next post, and a sync outpaced it by seconds that
            # run.finish() then waited (docs/performance.md). One post per 2 s is
            # a quarter of W&B's default limit of 2 requests/s per run (W&B docs, rate limits).
            x_file_stream_transmit_interval=FILE_STREAM_INTERVAL,
            # The file_stream's account of its requests, which confirms an
            # upload (_unconfirmed), is logged at INFO: never at a level above it.
            x_log_level=logging.INFO,
            **_retry_settings(),
        )
        directory.mkdir(parents=True, exist_ok=True)
        self._images = directory / "walbuf-images"  # each image's PNG, until wandb has copied it
        self._batcher: _Batcher | None = None  # while in batched()
        self._rows = 0  # history rows handed to wandb: what W&B must be seen to have taken
        self._finishing = finish_state and shared  # its last file_stream request must carry the finish
        try:
            self._run = wandb.init(
                id=target.wandb_id,
                project=target.project,
                entity=target.entity,
                name=name,
                config=config or None,
                dir=str(directory),
                settings=settings,
                reinit="create_new",
            )
        except wandb.errors.WandbCoreNotAvailableError as exc:
            raise ConfigError(f"wandb cannot run its upload process: {_describe(exc)}; {_REINSTALL}") from exc
        except OSError as exc:
            if not str(exc.filename or "").endswith("wandb-core"):
                raise
            # wandb-core is there but cannot be executed (not executable, not a program for this machine).
            raise ConfigError(f"wandb cannot run its upload process: {_describe(exc)}; {_REINSTALL}") from exc
        except wandb.errors.AuthenticationError as exc:
            raise ConfigError(f"W&B refused the credentials: {_describe(exc)}; {_LOGIN}") from exc
        except wandb.errors.UsageError as exc:
            if "API key" in str(exc) or "login" in str(exc):  # wandb's own words say `wandb login` already
                raise ConfigError(f"wandb refused to start the upload: no W&B API key was found; {_LOGIN}") from exc
            raise ConfigError(f"wandb refused to start the upload: {_describe(exc)}; fix the setting it names") from exc
        except wandb.errors.Error as exc:
            doing = f"opening W&B run {target.wandb_id!r}"
            raise init_failure(exc, _init_log(directory), doing) from exc
        except ValueError as exc:  # wandb's settings (pydantic) refusing an environment variable
            raise ConfigError(
                f"wandb refused a setting: {_settings_problem(exc)}; check WANDB_BASE_URL and the other WANDB_*"
                " variables of this environment"
            ) from exc

    @property
    def target(self) -> Target:
        """The run's target as wandb resolved it (its default project and entity filled in)."""
        return Target(self._run.id, self._run.project or None, self._run.entity or None)

    @property
    def offline_dir(self) -> str | None:
        """The offline run directory (what `wandb sync` takes), in offline mode."""
        if self.mode != "offline":
            return None
        return str(Path(self._run.dir).parent)

    def define_metric(self, key: str, step_metric: str) -> None:
        """Declare ``key`` to be plotted against ``step_metric`` (both history keys, as logged).

        Raises RowRefused if wandb refuses the name.
        """
        import wandb

        try:
            with _core_connection("declaring metrics"):
                self._run.define_metric(_escape(key), step_metric=_escape(step_metric))
        except (ValueError, TypeError, wandb.errors.Error) as exc:  # local: about the name, not the network
            raise RowRefused(f"wandb refused to declare metric {key!r}: {_describe(exc)}") from exc

    def update_summary(self, summary: dict[str, Any]) -> None:
        """Set the run's summary (after the rows: a row would replace a key it also holds).

        Histograms in their stored form are sent as wandb.Histogram; an
        image's reference as W&B keeps it (what :meth:`log` returned) as it is.
        """
        with _core_connection("sending the summary"):
            self._run.summary.update(_histograms(summary))

    def log(self, row: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """Send one history row (histograms and images in their stored form); RowRefused if wandb refuses its data.

        Returns the row's images as W&B holds them in the row: key -> the
        reference to the image's file, which wandb uploads with the run.
        """
        if dict not in map(type, row.values()):  # the common case: no histogram, no image
            self._log(row, step)
            return {}
        row = _histograms(row)
        files: list[Path] = []
        try:
            images = self._wandb_images(row, files)
            self._log({**row, **images}, step)
        finally:
            for file in files:
                file.unlink(missing_ok=True)
        # wandb copied each file into its run folder while logging (Media.bind_to_run).
        return {key: image.to_json(self._run) for key, image in images.items()}

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Rows and definitions sent in the block reach wandb-core together, in order, when it ends.

        wandb hands each record to its asyncio thread and waits for that
        thread to write it (interface_sock.py: _publish -> asyncer.run), one
        wake-up per row, most of a row's time in a sync. In the block, the
        records wandb would publish one by one are kept, then handed over in
        one call. Anything that waits for wandb-core's answer first hands
        over what is kept. An exception leaving the block drops what is kept
        (the upload fails; nothing is marked synced). With a wandb this was
        not checked against (see _Batcher.of), each record goes as before.
        """
        batcher = _Batcher.of(self._run)
        if batcher is None:
            yield
            return
        with batcher.installed():
            self._batcher = batcher
            try:
                yield
                with _core_connection("sending history"):
                    batcher.flush()
            finally:
                self._batcher = None

    def _log(self, row: dict[str, Any], step: int | None) -> None:
        try:
            with _core_connection("sending history"):
                if self._batcher is not None and step is None and _PLAIN.issuperset(map(type, row.values())):
                    self._batcher.log(self._run, row)
                else:
                    self._run.log(row, step=step)  # wandb.log copies the row
        except (ValueError, TypeError) as exc:
            raise RowRefused(f"wandb refused the row: {_describe(exc)}") from exc
        self._rows += 1

    def _wandb_images(self, row: dict[str, Any], files: list[Path]) -> dict[str, Any]:
        """The stored images of ``row`` as wandb.Image objects of files in the working folder (added to ``files``)."""
        import wandb

        pil = _pillow()
        images = {}
        for key, value in row.items():
            if type(value) is not dict or value.get("_type") != IMAGE:
                continue
            try:
                png = png_of(value)
                with pil.open(io.BytesIO(png)) as decoded:  # in memory: what fails is the data
                    # open() read the header only. What the buffer says of the
                    # image bounds what decoding it takes: no more than log() let in.
                    if decoded.size != (value["width"], value["height"]):
                        raise RowRefused(
                            f"image {key!r} is stored as {value['width']}x{value['height']} pixels, but its PNG"
                            f" is {decoded.width}x{decoded.height}: walbuf does not write such an image"
                        )
                    decoded.load()
            except (MetricValueError, OSError, SyntaxError, ValueError, pil.DecompressionBombError) as exc:
                raise RowRefused(f"image {key!r} cannot be read: {_describe(exc)}") from exc
            self._images.mkdir(exist_ok=True)
            path = self._images / f"{hashlib.sha256(png).hexdigest()}.png"
            files.append(path)
            path.write_bytes(png)
            images[key] = wandb.Image(str(path), caption=value["caption"])
        return images

    def mark_preempting(self) -> None:
        """Tell W&B the run will send more later (wandb-core's "preempting" signal on the file_stream).

        W&B marks a run crashed after about 5 minutes without a heartbeat
        (W&B docs, sweeps "signal handling"); a run marked preempting is
        shown preempting, then preempted, instead: "the run isn't dead and
        [will] send more updates later" (core filestream/filestreamrequest.go).
        """
        with _core_connection("marking the run preempting"):
            self._run.mark_preempting()

    def finish(self, exit_code: int | None = None) -> None:
        """End the upload; raise UploadError or ConfigError unless wandb confirms everything was uploaded.

        ``exit_code`` is the job's, sent as the run's state when the run was
        opened with ``finish_state``.
        """
        import wandb

        with contextlib.suppress(FileNotFoundError):
            self._images.rmdir()  # empty: each image's file goes once wandb has copied it
        try:
            with _core_connection("finishing the upload"):
                self._run.finish(exit_code=exit_code)
        except wandb.errors.Error as exc:
            raise failure(str(exc), "finishing the upload") from exc
        problem, refused_files = _upload_failure(self._run)
        if problem is not None:
            raise failure(problem, "uploading")
        if self.mode == "online":
            unconfirmed = _unconfirmed(Path(self._run.settings.log_internal), self._rows, self._finishing)
            if unconfirmed is not None:
                raise UploadError(
                    f"W&B did not confirm the upload: {unconfirmed}; so nothing was marked synced, and the next"
                    " sync sends it again (retry later)"
                )
        if refused_files:
            # A per-file refusal of W&B's storage (an upload URL that expired, a
            # bucket policy) says nothing of the run's target: retry later.
            refused = list(dict.fromkeys(refused_files))  # one line per try of a file
            names = ", ".join(refused[:3]) + (f" and {len(refused) - 3} more" if len(refused) > 3 else "")
            raise UploadError(
                f"W&B's file storage refused the upload of {names}, so nothing was marked synced; retry later"
                " (storage refuses an upload URL that expired; the next sync asks W&B for new ones)"
            )

    def abandon(self) -> None:
        """End the upload unfinished: nothing more of it is sent, and the next upload may open the run again.

        For an upload cut off in this process (an exception before finish());
        none of it is marked synced, and the service ends as restart_wandb() ends it.
        """
        restart_wandb()


# The wandb releases walbuf's sync is tested with (pyproject.toml says the
# same): it reaches into wandb's internals and wandb-core's messages
# (docs/wandb-server.md lists them), which any release may change.
WANDB_OLDEST = (0, 31, 0)
WANDB_BEYOND = (0, 32, 0)
WANDB_RANGE = "wandb>=0.31.0,<0.32"


def check_wandb() -> None:
    """ConfigError, before anything is planned or sent, where the installed wandb is outside WANDB_RANGE."""
    import wandb

    version = str(getattr(wandb, "__version__", "unknown"))
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    release = tuple(int(n) for n in found.groups()) if found else None
    if release is None or not WANDB_OLDEST <= release < WANDB_BEYOND:
        raise ConfigError(
            f"walbuf's sync is tested with {WANDB_RANGE}, and this environment has wandb {version}: install one of"
            f" those (pip install '{WANDB_RANGE}'), or a walbuf tested with yours; nothing was sent"
        )


class _Batcher:
    """Keeps the records a wandb run publishes, and hands them to wandb's asyncio thread in one call.

    Relies on wandb's internals (a run's ``_interface``, an InterfaceSock
    with ``_publish``, ``_deliver``, ``_assign``, ``_asyncer`` and
    ``_client``), as they are in the wandb versions of TESTED_WANDB.
    """

    TESTED_WANDB = ("0.31.0",)

    def __init__(self, interface: Any, request_type: Any) -> None:
        self._interface = interface
        self._request_type = request_type
        self._kept: list[Any] = []

    @classmethod
    def of(cls, run: Any) -> _Batcher | None:
        """A batcher for ``run``'s records; None if this wandb is not one it was checked against."""
        import wandb

        if wandb.__version__ not in cls.TESTED_WANDB:
            return None
        from wandb.sdk.interface.interface_sock import InterfaceSock

        interface = getattr(run, "_interface", None)
        if type(interface) is not InterfaceSock:
            return None
        messages: Any = importlib.import_module("wandb.proto.wandb_server_pb2")  # generated: no types to check
        return cls(interface, messages.ServerRequest)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """For the block, the run's interface keeps what it publishes (instance attributes over its methods)."""
        interface = self._interface
        interface._publish = self._keep
        interface._deliver = self._flush_then_deliver
        try:
            yield
        finally:
            del interface._publish, interface._deliver  # its own methods again
            self._kept = []

    def log(self, run: Any, row: dict[str, Any]) -> None:
        """What ``run.log(row)`` publishes, built here: a row of plain values (_PLAIN), with its _timestamp.

        wandb's run.log passes each row through layers that change nothing
        in a row of numbers and strings (history_dict_to_json converts media
        and numpy values; a step or commit given; tensorboard) and then
        builds this request (interface.publish_partial_history); they took
        about as long as the rest of the sync's work on a row together.
        """
        pb: Any = importlib.import_module("wandb.proto.wandb_internal_pb2")  # generated: no types to check
        from wandb.sdk.interface.history_value import set_history_value
        from wandb.sdk.wandb_settings import HISTORY_VALUE_ENCODING_JSON, HISTORY_VALUE_ENCODING_TYPED

        encoding = run._settings.x_history_value_encoding.split(",")
        json_form = HISTORY_VALUE_ENCODING_JSON in encoding
        typed_form = HISTORY_VALUE_ENCODING_TYPED in encoding
        request = pb.PartialHistoryRequest()
        for key, value in row.items():
            item = request.item.add()
            item.key = key
            set_history_value(item, value, json_form=json_form, typed_form=typed_form)
        self._interface._publish_partial_history(request)
        run._local_step += 1  # as run.log without a step or commit

    def _keep(self, record: Any, *, nowait: bool = False) -> None:
        # What InterfaceSock._publish builds, kept instead of sent.
        self._interface._assign(record)
        request = self._request_type()
        request.record_publish.CopyFrom(record)
        self._kept.append(request)

    def _flush_then_deliver(self, record: Any) -> Any:
        self.flush()
        return type(self._interface)._deliver(self._interface, record)

    def flush(self) -> None:
        """Hand over what is kept, in order, in one call to wandb's asyncio thread."""
        kept, self._kept = self._kept, []
        if not kept:
            return
        client = self._interface._client

        async def publish_all() -> None:
            for request in kept:
                await client.publish(request)

        self._interface._asyncer.run(publish_all)


@contextlib.contextmanager
def _core_connection(doing: str) -> Iterator[None]:
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
        _teardown(wandb)
        raise UploadError(
            f"wandb-core, the process wandb uploads through, ended while {doing} ({_describe(exc)}): it was"
            " killed or ran out of memory; nothing was marked synced; retry later"
        ) from exc


# The values of a row _Batcher.log builds as run.log would: JSON's own, which
# wandb's history_dict_to_json passes through unchanged.
_PLAIN = frozenset({int, float, bool, str, type(None)})


class RowRefused(Exception):
    """wandb refused one row's data: the same row would be refused again. Caught by the syncer."""


_REINSTALL = "reinstall wandb for this machine (pip install --force-reinstall wandb); a retry gets the same"


def _settings_problem(exc: ValueError) -> str:
    """What pydantic's ValidationError of wandb's Settings says of each setting (its first line names none)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return _describe(exc)
    try:
        found = errors(include_url=False)
    except TypeError:
        return _describe(exc)
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in found]
    return "; ".join(parts) or _describe(exc)


_LOGIN = "run `wandb login` or set WANDB_API_KEY (and WANDB_BASE_URL for a private server)"
_STATUS = re.compile(r"\bHTTP (\d{3})\b|\b(\d{3}) [A-Z][a-z]+(?: [A-Z][a-z]+)* url=|\"status\":(\d{3})")


def failure(message: str, doing: str) -> WalbufError:
    """The error for a failure of wandb's: UploadError if a retry can fix it, else ConfigError.

    A retry can fix what has no HTTP status (a refused or dropped
    connection, a timeout), a 5xx, a 408 or a 429. Any other 4xx is the
    server's answer, and it will answer the same way next time.
    """
    codes = [int(next(g for g in m if g)) for m in _STATUS.findall(message)]
    lasting = [c for c in codes if 400 <= c < 500 and c not in (408, 429)]
    first_line = message.strip().splitlines()[0] if message.strip() else "no detail"
    if not lasting:
        return UploadError(f"W&B failed while {doing}, so nothing was marked synced: {first_line}; retry later")
    code = lasting[-1]
    lines = message.strip().splitlines()
    detail = next((line for line in lines if str(code) in line), lines[-1])[:300]
    if code == 401:
        return ConfigError(f"W&B refused {doing} (HTTP 401): {detail}; {_LOGIN}")
    if code in (403, 404, 409):
        if "previously created and deleted" in message:
            advice = (
                "W&B does not take a deleted run's id again: restore the run in W&B (a deleted run can be"
                " restored for a while), or give another with --run-id"
            )
        else:
            advice = "check the project and entity (walbuf status shows them) and that your W&B user may write there"
        return TargetRefusedError(f"W&B refused {doing} (HTTP {code}): {detail}; {advice}")
    return ConfigError(f"W&B refused {doing} (HTTP {code}): {detail}; W&B answers this the same way each time")


# GraphQL errors in a reply with status 200: genqlient returns them as a
# gqlerror.List ("input: <path> <message>"), which wandb-core passes up as
# "Error initializing run: ..." (core runupserter/runupdatework.go, runInitErrorResult).
_GRAPHQL_ERRORS = re.compile(r"^Error initializing run: input: (?:\S+ )?(.+)", re.DOTALL)
# The status of a refused UpsertBucket, as wandb-core's log keeps it
# (genqlient's HTTPError: "returned error 403: {body}").
_INIT_STATUS = re.compile(r"returned error (\d{3})\b")
# What Go's HTTP client says of TLS that cannot work (retryablehttp does not
# retry these: its DefaultRetryPolicy, "certificate" and the like).
_TLS = re.compile(r"server gave HTTP response to HTTPS client|x509: |tls: ")
_CREDENTIALS = re.compile(r"api.?key|not logged in|unauthori[sz]ed|unauthenticated|authenticat", re.IGNORECASE)


def init_failure(exc: Exception, log: str, doing: str) -> WalbufError:
    """The error for wandb.init failing: what the server answered, told apart from what a retry can fix.

    wandb-core reports the server's refusal of its first request by its
    text alone, without the HTTP status (core runupserter/runupdateerror.go,
    fromGQLError), as a CommError: it comes from a status that wandb-core's
    retry policy does not retry (400, 401, 403, 404, 410, 422 and the like:
    core clients/retry_policy.go), so it is the server's lasting answer.
    GraphQL errors in a 200 reply are the server's answer too. Both are
    refusals: a retry gets the same; the message is the server's words.
    TLS that cannot work (https against a plain-http server, a certificate
    not trusted) is lasting too. Timeouts, exhausted retries (which keep
    "HTTP 5xx" in the text) and connection failures (a name that does not
    resolve included: a node without network) go to failure().
    """
    import wandb

    message = str(exc).strip()
    words = message.splitlines()[0][:300] if message else "no detail"
    refused = isinstance(exc, wandb.errors.CommError) and not message.startswith("Timed out")
    graphql = _GRAPHQL_ERRORS.match(message)
    if graphql is not None:
        words = graphql.group(1).strip().splitlines()[0][:300]
    if _TLS.search(message):
        return ConfigError(
            f"W&B could not be reached securely while {doing}: {words}; check WANDB_BASE_URL's scheme (https or"
            " http, as the server answers) and the server's certificate; a retry gets the same"
        )
    if not refused and graphql is None:
        return failure(message, doing)
    status = next(iter(_INIT_STATUS.findall(log)), None)
    answer = f"HTTP {status}" if status is not None else "a GraphQL error"
    if status == "401" or _CREDENTIALS.search(words):
        return ConfigError(f"W&B refused {doing} ({answer}): {words}; {_LOGIN}")
    advice = "check the project and entity (walbuf status shows them) and that your W&B user may write there"
    return TargetRefusedError(f"W&B refused {doing} ({answer}): {words}; {advice}")


def _init_log(directory: Path) -> str:
    """The ERROR lines wandb-core logged for an init that failed, under ``directory`` ("" if none)."""
    lines = []
    for path in sorted(directory.glob("wandb/*/logs/debug-internal.log")):
        if path.is_symlink():
            continue
        with path.open(encoding="utf-8", errors="replace") as log:
            lines += [line for line in log if '"level":"ERROR' in line]
    return "".join(lines)


def renew_wandb() -> None:
    """Between uploads: end wandb's service in this process, gracefully; the next upload starts one afresh.

    wandb-core keeps memory for each run it served (see walbuf.syncer.follow.RENEW_EVERY).
    """
    import wandb

    _teardown(wandb)


def restart_wandb() -> None:
    """End wandb's service in this process, so that the next upload starts one afresh.

    After a failed upload wandb's service may still hold the run (the next
    wandb.init of its id fails: "run ID ... is in use") and still retry what
    it was sending. Its wandb-core is killed (nothing more is sent of the
    failed upload, none of which is marked synced) and wandb's side torn down.
    """
    import wandb

    kill_wandb_core()
    _teardown(wandb)


def _teardown(wandb: Any) -> None:
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


def _own_service_only() -> None:
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


def _histograms(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each histogram in its stored form (a dict) made a wandb.Histogram of the same bins and counts."""
    if not any(type(v) is dict and v.get("_type") == HISTOGRAM for v in values.values()):
        return values  # the common case: scalars only
    import wandb

    return {
        key: wandb.Histogram(np_histogram=(value["values"], value["bins"]))
        if type(value) is dict and value.get("_type") == HISTOGRAM
        else value
        for key, value in values.items()
    }


def _pillow() -> Any:
    try:
        import PIL.Image
    except ImportError:
        raise MissingExtraError(
            "the run has images, and sending them needs Pillow: pip install 'walbuf[media]' where walbuf sync runs"
        ) from None
    return PIL.Image


def _escape(key: str) -> str:
    # wandb-core reads "." in define_metric names as nesting ("a.b" is b inside
    # a) unless escaped; history keys are flat, so every dot is literal.
    return key.replace(".", "\\.")


def _retry_settings() -> dict[str, Any]:
    """Bounded retries: a W&B server that stays unreachable fails the sync in well under a minute.

    The next sync (cron's next run) is the real retry; these only ride out
    a blip.
    """
    return {
        "x_graphql_retry_max": 3,
        "x_graphql_retry_wait_min_seconds": 1,
        "x_graphql_retry_wait_max_seconds": 5,
        "x_file_stream_retry_max": 3,
        "x_file_stream_retry_wait_min_seconds": 1,
        "x_file_stream_retry_wait_max_seconds": 5,
        "x_file_transfer_retry_max": 3,
        "x_file_transfer_retry_wait_min_seconds": 1,
        "x_file_transfer_retry_wait_max_seconds": 5,
    }


_TASK_NAME = re.compile(r"\bName: ([^,]+),")  # wandb-core's DefaultUploadTask, as it logs one


def _upload_failure(run: Any) -> tuple[str | None, list[str]]:
    """What wandb-core logged as errors for this run: the errors ("\n" joined, or None), and the files storage refused.

    run.finish() returns normally even when wandb-core gave up on the upload
    (seen with wandb 0.31: the file_stream failing with HTTP 500, or the
    server gone, after retries). What wandb-core does report is an ERROR
    record in the run's internal log (JSON lines, settings.log_internal);
    each sync has a run directory of its own, so every line there is about
    this upload. Any error counts: the records stay pending and are sent
    again, at worst twice, never lost. The lines keep their HTTP status
    (a "status" field, or "HTTP 500" in the message), which says whether a
    retry can help (see failure()). A file's upload to storage (a PUT to
    the URL W&B gave, or wandb-core's "file transfer" line) is told apart:
    storage refusing one file is no answer about the run's target.
    """
    path = Path(run.settings.log_internal)
    if not path.exists():
        return "wandb wrote no internal log, so the upload cannot be confirmed", []
    errors: list[str] = []
    files: list[str] = []
    with path.open(encoding="utf-8", errors="replace") as log:
        for line in log:
            if '"level":"ERROR' not in line:
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                errors.append(line.strip())
                continue
            message = str(entry.get("msg", line.strip()))
            if entry.get("method") == "PUT" and isinstance(entry.get("url"), str):
                continue  # the HTTP layer's line of a refused file; the transfer's line below names the file
            if message.startswith("file transfer:"):
                named = _TASK_NAME.search(str(entry.get("task", "")))
                files.append(named.group(1) if named else message[:200])
                continue
            status = f' "status":{entry["status"]}' if isinstance(entry.get("status"), int) else ""
            errors.append(f"{message}{status}")
    return ("\n".join(errors) if errors else None), files


def _unconfirmed(log: Path, rows: int, finishing: bool) -> str | None:
    """Why wandb-core's own account of an online upload does not show W&B taking all of it (None: it does).

    The evidence is positive: wandb-core's file_stream logs each request it
    makes ("filestream: sending request", with the history lines it carries
    and whether it finishes the run) and, only once W&B answered it with
    success, "filestream: request sent" with the HTTP status (wandb 0.31,
    core filestream/filestreamimpl.go send() and logRequestSummary; requests
    go one at a time, transmitloop.go). The upload counts as confirmed when
    every request of this run's stream (the lines after its last "stream:
    starting": the log is opened for appending, and two uploads of one run
    in one second share a run folder) was answered 2xx, the answered ones
    carry at least the ``rows`` handed over, and, when ``finishing``, one
    of them carried the run's finish. A log that is missing, empty, cut off
    or in a form this does not know confirms nothing.
    """
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return "wandb-core wrote no log of the upload, which is where it accounts for what W&B took"
    requests: list[dict[str, Any]] = []  # each: the request's own log line, "status" added once answered
    started = False
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut off (the log's disk full): it confirms nothing
        if not isinstance(entry, dict):
            continue
        message = entry.get("msg")
        if message == "stream: starting":
            started, requests = True, []
        elif message == "filestream: sending request":
            requests.append(entry)
        elif message == "filestream: request sent" and requests:
            requests[-1]["status"] = str(entry.get("status", ""))
    if not started:
        return "wandb-core's log holds no account of the upload (it is empty, or in a form walbuf does not know)"
    answered = [r for r in requests if r.get("status", "").startswith("2")]
    if len(answered) < len(requests):
        return f"W&B answered {len(answered)} of wandb-core's {len(requests)} file_stream requests"
    lines = sum(r["history_lines"] for r in answered if isinstance(r.get("history_lines"), int))
    if lines < rows:
        return f"W&B took {lines:,} of the {rows:,} history rows handed to wandb"
    if finishing and not any(r.get("complete") is True for r in answered):
        return "W&B was not seen to take the run's finish"
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
