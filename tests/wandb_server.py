"""A fake W&B backend that the real, unmodified wandb SDK talks to over 127.0.0.1.

It answers the GraphQL operations wandb-core 0.31 sends for init, log and
finish (UpsertBucket, CreateRunFiles, Viewer and server-info queries; any
other operation gets an empty answer and is listed in ``unknown_operations``),
accepts the file uploads it hands out URLs for, and the file_stream endpoint,
and records what it received per run: history rows, summary, config (where
define_metric's definitions arrive, as ``config["_wandb"]["value"]["m"]``),
uploaded files, and whether the run was marked complete.

file_stream posts carry, per file, an ``offset`` (the line number of their
first line in that file) and ``content``. Like the real server, the fake
keeps lines by offset, so a post the client retries does not duplicate rows.
Each wandb process writes its own stream, and offsets restart at 0 in each:
in shared mode several processes write one run. wandb-core 0.31 names its
stream in the ``X-Wandb-Async-Client-Id`` header, and the fake keeps offsets
per (client id, file).

Config and summary are each replaced whole by the latest update: config by
the latest UpsertBucket that carries one (wandb-core re-sends the whole
config with each, runupserter.go and runconfig.go; a shared-mode process
sends only the metric definitions it made, and reports have the latest
writer's replace the rest, wandb issue 4377: the strict case), summary by
the latest wandb-summary.json line (the client sends its whole summary as
one line at offset 0, filestreamstate.go; last writer wins, wandb issue
4882).

Rules of the real server it keeps, each with its source:

- One mode per run: a shared-mode writer (its file_stream posts carry
  ``X-WANDB-USE-ASYNC-FILESTREAM: true``, core/internal/stream/stream_init.go)
  sending history to a run whose history a non-shared writer sent (as
  `wandb sync` of an offline run does) is answered 409, "cannot enable shared
  mode for run ... with existing history", and its rows are dropped (what
  users' tools report meeting on the file_stream: ../shared/wandb-server-notes.md,
  "Mixing modes"). W&B staff call mixing modes unsupported (wandb issue
  12269, whose report is of rows silently overwritten instead: either way
  rows are lost, and walbuf refuses to mix modes before the server can).
- A history or summary line over MAX_LINE_BYTES is not kept (``dropped_lines``).
- Run state (``state(run_id)``; W&B docs, "run states"): finished or failed
  once a writer sent ``complete`` (by its exit code); else crashed once the
  server has heard nothing for STALE_SECONDS, 5 minutes (W&B docs, sweeps
  "signal handling"; the stale-runs sweep of wandb PR 12500), or preempted
  if the last writer said ``preempting`` ("the run isn't dead and [will]
  send more updates later": core filestream/filestreamrequest.go); else
  running, or preempting until another writer sends. The server's clock is
  the fake's: ``advance(seconds)`` moves it.

- A run id that was created and then deleted cannot be used again: its
  UpsertBucket is answered 409, "run E/P/ID was previously created and
  deleted; try a new run name" (wandb issues 1192, 4897, 10669; the message
  and status as the server sends them). ``delete_run(id)`` deletes one.
- A refused UpsertBucket (no permission, no such project, a revoked key)
  is answered with a status and a GraphQL error carrying the server's
  words and a code: ``{"errors":[{"message":"permission denied","path":
  ["upsertBucket"],"extensions":{"code":"PERMISSION_ERROR"}}],"data":
  {"upsertBucket":null}}`` with 403, as users quote W&B's answer (wandb
  issues 8609 and 8800; open-r1 issue 323). A GraphQL server may give such
  errors in a 200 reply too (GraphQL over HTTP). ``refuse_upserts(status,
  message, code)`` answers so.
- Rate limits: a 429 with a Retry-After header, which the client honours
  and retries (W&B docs, "limits"; wandb-core's retry policy, backoff.go).
  ``rate_limit(n)`` answers the next n requests so.

Faults for tests: ``go_down()`` closes the listening socket (connections are
refused) and drops the connections already open, as a server or network that
goes away does (a client's kept-alive connection then fails on its next
request: RFC 9112 section 9.6, a server may close an idle connection at any
time); ``go_up()`` listens again on the same port; ``fail_with(500)``
answers every request (or only "graphql" or "file_stream") with that status;
``fail_history_after(n, 500)`` accepts n history posts, then fails the rest;
``hold_uploads()`` records history posts but leaves them unanswered until
``release_uploads()``: the client waits for a confirmation that does not come;
``stall()`` leaves every request unanswered (a server that accepts
connections and never answers) until ``unstall()``; ``when_history_arrives(f)``
calls f once, as the next history post arrives and before it is taken (the
world changing while an upload is under way: a disk filling, say).
"""

from __future__ import annotations

import base64
import gzip
import json
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

API_KEY = "walbuftest" + "0" * 30  # 40 characters, no dash (wandb splits keys at the first dash)

# The longest history or summary line kept: wandb-core drops longer ones before
# sending (core/internal/filestream/filestream.go, defaultMaxFileLineBytes;
# updatehistory.go); the server is assumed to keep no longer line either.
MAX_LINE_BYTES = (10 << 20) - (100 << 10)
# How long the server waits for a heartbeat before it marks a run crashed (see the rules above).
STALE_SECONDS = 300.0


@dataclass
class FakeRun:
    """What the server holds of one run."""

    entity: str
    project: str
    id: str
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    upserts: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    complete: bool = False
    exit_code: int | None = None
    display_name: str | None = None
    preempting_stream: str | None = None  # the writer that said the run will send more later, until another sends
    last_heard: float = 0.0  # the server's clock at its last request
    # (client stream, file name) -> {line offset: line}
    lines: dict[tuple[str, str], dict[int, str]] = field(default_factory=dict)
    non_shared_history: bool = False  # a writer not in shared mode sent history (`wandb sync` of an offline run)
    refused_posts: int = 0  # file_stream posts refused because of that
    dropped_lines: int = 0  # lines over MAX_LINE_BYTES, not kept

    def metric_definitions(self) -> dict[str, str | None]:
        """metric name -> its step metric's name, from the latest config's ``_wandb.m``.

        wandb-core numbers the fields of each definition: "1" name, "2" glob
        name, "5" the 1-based index of the step metric's own entry in the list.
        """
        entries = self.config.get("_wandb", {}).get("value", {}).get("m", [])
        names = [e.get("1") or e.get("2") for e in entries]
        return {
            names[i]: (names[e["5"] - 1] if e.get("5") else None) for i, e in enumerate(entries) if names[i] is not None
        }

    def step_metric_of(self, key: str) -> str | None:
        """The step metric W&B plots history key ``key`` against: its own definition, else a glob's.

        Names in definitions escape a literal "." as "\\."; a glob is a prefix
        followed by "*" (wandb-core's runmetric.go, matchGlobMetric).
        """
        defined = {name.replace("\\.", "."): step for name, step in self.metric_definitions().items()}
        unescaped = {name: (step.replace("\\.", ".") if step else None) for name, step in defined.items()}
        if key in unescaped and not key.endswith("*"):
            return unescaped[key]
        for name, step in unescaped.items():
            if name.endswith("*") and key.startswith(name[:-1]):
                return step
        return None


class FakeWandb:
    """The server. Use as a context manager, or start() and stop()."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self.runs: dict[tuple[str, str, str], FakeRun] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, graphql operation)
        self.unknown_operations: list[str] = []
        self._failure: tuple[int, str] | None = None
        self._history_budget: tuple[int, int] | None = None  # (posts still accepted, status after)
        self._rate_limited = 0
        self.deleted: set[str] = set()
        self._refusal: tuple[int, str, str] | None = None
        self._storage_refusal: int | None = None
        self._clock_ahead = 0.0
        self._on_history: Callable[[], None] | None = None
        self._released = threading.Event()
        self._released.set()
        self._answering = threading.Event()
        self._answering.set()
        self._server: ThreadingHTTPServer | None = None
        self.port = _free_port()

    # -- lifecycle -------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for a process whose wandb should talk to this server and nowhere else."""
        return {
            "WANDB_BASE_URL": self.url,
            "WANDB_API_KEY": API_KEY,
            "WANDB_SILENT": "true",
            "WANDB_DISABLE_GIT": "true",
            "WANDB_ERROR_REPORTING": "false",
        }

    def start(self) -> None:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._server = _Server(("127.0.0.1", self.port), handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._released.set()
        self._answering.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FakeWandb:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- faults ----------------------------------------------------------------

    def go_down(self) -> None:
        """Stop listening and drop open connections: clients get "connection refused" or a reset."""
        self.stop()

    def go_up(self) -> None:
        """Listen again on the same port."""
        self.start()

    def fail_with(self, status: int | None, paths: str = "all") -> None:
        """Answer requests to ``paths`` ("all", "graphql", "file_stream") with ``status``; None heals."""
        assert paths in ("all", "graphql", "file_stream")
        self._failure = None if status is None else (status, paths)

    def fail_history_after(self, accepted: int, status: int) -> None:
        """Accept ``accepted`` more file_stream posts that carry history, then answer the rest with ``status``."""
        self._history_budget = (accepted, status)

    def rate_limit(self, requests: int) -> None:
        """Answer the next ``requests`` requests with 429 and Retry-After: 1."""
        with self._lock:
            self._rate_limited = requests

    def refuse_upserts(self, status: int, message: str, code: str) -> None:
        """Answer each UpsertBucket as W&B refuses one: ``status`` and a GraphQL error with ``message`` and ``code``."""
        self._refusal = (status, message, code)

    def refuse_file_uploads(self, status: int | None) -> None:
        """Answer each file upload (a PUT to the URL CreateRunFiles gave) with ``status`` as storage does; None
        heals."""
        self._storage_refusal = status

    def advance(self, seconds: float) -> None:
        """Move the server's clock on, as if ``seconds`` passed with nothing heard."""
        with self._lock:
            self._clock_ahead += seconds

    def now(self) -> float:
        return time.monotonic() + self._clock_ahead

    def state(self, run_id: str) -> str:
        """The run's state as W&B would show it now (see the rules above)."""
        with self._lock:
            run = self.run(run_id)
            if run.complete:
                return "finished" if run.exit_code == 0 else "failed"
            if self.now() - run.last_heard >= STALE_SECONDS:
                return "preempted" if run.preempting_stream is not None else "crashed"
            return "preempting" if run.preempting_stream is not None else "running"

    def rename(self, run_id: str, name: str) -> None:
        """Rename a run, as a user does in W&B's UI."""
        with self._lock:
            self.run(run_id).display_name = name

    def delete_run(self, run_id: str) -> None:
        """Delete a run (in any project): its id may not be used again (409)."""
        with self._lock:
            self.deleted.add(run_id)
            for key in [k for k in self.runs if k[2] == run_id]:
                del self.runs[key]

    def stall(self) -> None:
        """Accept connections, and answer nothing until unstall()."""
        self._answering.clear()

    def unstall(self) -> None:
        self._answering.set()

    def hold_uploads(self) -> None:
        """Record history posts but leave them unanswered until release_uploads()."""
        self._released.clear()

    def release_uploads(self) -> None:
        self._released.set()

    def when_history_arrives(self, action: Callable[[], None]) -> None:
        """Call ``action`` once, as the next history post arrives, before it is taken."""
        self._on_history = action

    def history_arriving(self) -> None:
        with self._lock:
            action, self._on_history = self._on_history, None
        if action is not None:
            action()

    # -- what arrived ----------------------------------------------------------

    def run(self, run_id: str) -> FakeRun:
        """The run with this id (in whichever entity and project it arrived)."""
        found = [r for (_, _, rid), r in self.runs.items() if rid == run_id]
        assert len(found) == 1, f"run {run_id!r}: {len(found)} runs with that id; runs: {list(self.runs)}"
        return found[0]

    def wait_for_rows(self, n: int, timeout: float) -> None:
        """Block until the server holds at least ``n`` history rows in all, or raise TimeoutError."""
        with self._changed:
            if not self._changed.wait_for(lambda: sum(len(r.history) for r in self.runs.values()) >= n, timeout):
                raise TimeoutError(f"fewer than {n} history rows arrived within {timeout}s")

    # -- request handling (called from the handler threads) --------------------

    def _run(self, entity: str, project: str, run_id: str) -> FakeRun:
        key = (entity, project, run_id)
        if key not in self.runs:
            self.runs[key] = FakeRun(entity, project, run_id)
        return self.runs[key]

    def rate_limited(self) -> bool:
        with self._lock:
            if self._rate_limited <= 0:
                return False
            self._rate_limited -= 1
            return True

    def history_refused(self, body: dict[str, Any]) -> int | None:
        """The status a history post gets once the budget of fail_history_after is spent."""
        if self._history_budget is None or "wandb-history.jsonl" not in (body.get("files") or {}):
            return None
        with self._lock:
            left, status = self._history_budget
            if left > 0:
                self._history_budget = (left - 1, status)
                return None
            return status

    def failing(self, kind: str) -> int | None:
        if self._failure is None:
            return None
        status, paths = self._failure
        return status if paths in ("all", kind) else None

    def graphql(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """(HTTP status, answer) for a GraphQL request."""
        query = body.get("query", "")
        variables = body.get("variables") or {}
        match = re.search(r"\b(?:query|mutation)\s+(\w+)", query)
        operation = match.group(1) if match else ""
        with self._lock:
            self.requests.append(("POST", "/graphql", operation))
            run_id = variables.get("name") or ""
            if operation == "UpsertBucket" and self._refusal is not None:
                status, message, code = self._refusal
                error = {"message": message, "path": ["upsertBucket"], "extensions": {"code": code}}
                return status, {"errors": [error], "data": {"upsertBucket": None}}
            if operation == "UpsertBucket" and run_id in self.deleted:
                entity = variables.get("entity") or "walbuf-test"
                project = variables.get("project") or "uncategorized"
                message = f"run {entity}/{project}/{run_id} was previously created and deleted; try a new run name"
                return 409, {"errors": [{"message": message}]}
            return 200, self._answer(operation, query, variables)

    def _answer(self, operation: str, query: str, variables: dict[str, Any]) -> dict[str, Any]:
        if operation == "UpsertBucket":
            return {"data": {"upsertBucket": self._upsert(variables)}}
        if operation == "CreateRunFiles":
            run = self._run(variables.get("entity") or "", variables.get("project") or "", variables.get("run") or "")
            base = f"{self.url}/upload/{run.entity}/{run.project}/{run.id}"
            return {
                "data": {
                    "createRunFiles": {
                        "runID": _graphql_id("Run", run.id),
                        "uploadHeaders": [],
                        "files": [{"name": f, "uploadUrl": f"{base}/{f}"} for f in variables.get("files") or []],
                    }
                }
            }
        if "viewer" in query:
            return {
                "data": {
                    "viewer": {
                        "id": _graphql_id("User", "1"),
                        "entity": "walbuf-test",
                        "username": "walbuf-test",
                        "flags": "{}",
                        "teams": {"edges": []},
                    }
                }
            }
        if "serverInfo" in query:
            # W&B's server expands glob metric definitions itself; wandb 0.31 no
            # longer asks (the x_server_side_expand_glob_metrics setting went as
            # "always true for supported server versions", PR 12844; the client
            # uploads only the glob, runupserter.go), so this answer is for older clients.
            features = [{"name": "EXPAND_DEFINED_METRIC_GLOBS", "isEnabled": True}]
            return {
                "data": {"serverInfo": {"features": features, "cliVersionInfo": {}, "latestLocalVersionInfo": None}}
            }
        if operation == "OrganizationCoreWeaveOrganizationID":
            return {"data": {"entity": None}}
        self.unknown_operations.append(operation or query[:60])
        return {"data": {}}

    def _upsert(self, variables: dict[str, Any]) -> dict[str, Any]:
        entity = variables.get("entity") or "walbuf-test"
        project = variables.get("project") or "uncategorized"
        run = self._run(entity, project, variables.get("name") or "")
        run.upserts.append(variables)
        run.last_heard = self.now()
        if variables.get("config"):
            run.config = json.loads(variables["config"])
        if variables.get("displayName"):
            run.display_name = variables["displayName"]
        return {
            "bucket": {
                "id": _graphql_id("Run", run.id),
                "name": run.id,
                "displayName": run.display_name or run.id,
                "description": "",
                "config": json.dumps(run.config),
                "sweepName": None,
                "historyLineCount": len(run.history),
                "project": {
                    "id": _graphql_id("Project", project),
                    "name": project,
                    "entity": {"id": _graphql_id("Entity", entity), "name": entity},
                },
            },
            "inserted": True,
        }

    def file_stream(
        self, entity: str, project: str, run_id: str, stream: str, body: dict[str, Any], shared: bool = False
    ) -> str | None:
        """Take one file_stream post; the refusal (answered 409) of a shared writer on a non-shared history."""
        with self._lock:
            self.requests.append(("POST", f"/files/{entity}/{project}/{run_id}/file_stream", None))
            run = self._run(entity, project, run_id)
            run.last_heard = self.now()
            if body.get("preempting"):
                run.preempting_stream = stream
            elif stream != run.preempting_stream:
                run.preempting_stream = None  # another writer is sending: running
            files = body.get("files") or {}
            if "wandb-history.jsonl" in files:
                if shared and run.non_shared_history:
                    run.refused_posts += 1
                    return f"cannot enable shared mode for run {entity}/{project}/{run_id} with existing history"
                if not shared:
                    run.non_shared_history = True
            for name, chunk in files.items():
                lines = run.lines.setdefault((stream, name), {})
                offset = chunk.get("offset", 0)
                for i, line in enumerate(chunk.get("content") or []):
                    if len(line.encode()) > MAX_LINE_BYTES:
                        run.dropped_lines += 1
                        continue
                    repeated = offset + i in lines
                    lines[offset + i] = line
                    if name == "wandb-history.jsonl" and not repeated:
                        run.history.append(json.loads(line))
                    elif name == "wandb-summary.json":
                        run.summary = json.loads(line)
            if body.get("complete"):
                run.complete = True
                run.exit_code = body.get("exitcode")
            self._changed.notify_all()
            return None

    def upload(self, path: str, data: bytes) -> None:
        _, _, entity, project, run_id, name = path.split("/", 5)
        with self._lock:
            self.requests.append(("PUT", path, None))
            self._run(entity, project, run_id).files[name] = data


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def server_close(self) -> None:
        """Close the listening socket and every connection still open.

        http.server alone leaves a handler thread serving its keep-alive
        connection after ``shutdown()``: the server would still answer a client
        that holds one, which no server that went away does.
        """
        super().server_close()
        with self._open_lock:
            still_open = list(self._open)
        for request in still_open:
            try:
                # shutdown, not close: the handler thread still owns the socket
                # and closes it; it reads EOF or gets EPIPE when it writes.
                request.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the client closed it first

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that exits drops its keep-alive connections: not an error here.
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeWandb
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def _body(self) -> bytes:
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.fake._answering.wait()
        if self.headers.get("Content-Encoding") == "gzip":
            data = gzip.decompress(data)
        return data

    def _reply(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        if status == 429:
            self.send_header("Retry-After", "1")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _reply_xml(self, status: int, body: str) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._body()
        self._reply(200, {})

    def do_PUT(self) -> None:  # noqa: N802
        data = self._body()
        failing = self.fake.failing("all")
        if failing:
            return self._reply(failing, {"error": "injected failure"})
        if self.path.startswith("/upload/"):
            if self.fake._storage_refusal is not None:
                return self._reply_xml(self.fake._storage_refusal, _STORAGE_DENIED)
            self.fake.upload(self.path, data)
        self._reply(200, {})

    def do_POST(self) -> None:  # noqa: N802
        raw = self._body()
        if self.path in ("/graphql", "/files") or self.path.endswith("/file_stream"):
            if self.fake.rate_limited():
                return self._reply(429, {"errors": [{"message": "rate limit exceeded"}]})
        if self.path == "/graphql":
            failing = self.fake.failing("graphql")
            if failing:
                return self._reply(failing, {"errors": [{"message": "injected failure"}]})
            return self._reply(*self.fake.graphql(json.loads(raw)))
        match = re.fullmatch(r"/files/([^/]+)/([^/]+)/([^/]+)/file_stream", self.path)
        if match:
            failing = self.fake.failing("file_stream")
            if failing:
                return self._reply(failing, {"error": "injected failure"})
            body = json.loads(raw)
            if "wandb-history.jsonl" in (body.get("files") or {}):
                self.fake.history_arriving()
            refused = self.fake.history_refused(body)
            if refused:
                return self._reply(refused, {"error": "injected failure after earlier batches were accepted"})
            shared = self.headers.get("X-Wandb-Use-Async-Filestream") == "true"
            client = self.headers.get("X-Wandb-Async-Client-Id", "")
            mixed = self.fake.file_stream(*match.groups(), client, body, shared=shared)
            if mixed is not None:
                return self._reply(409, {"error": mixed})
            if "wandb-history.jsonl" in (body.get("files") or {}) or body.get("complete"):
                self.fake._released.wait()
            return self._reply(200, {"exitcode": None, "limits": {}})
        # Telemetry (/sdk/otel/...) and anything else: accepted and ignored.
        self._reply(200, {})


# What S3 answers a PUT to a presigned URL that expired or that a bucket
# policy denies (AWS docs, "Error responses"; GCS answers the same shape).
_STORAGE_DENIED = (
    '<?xml version="1.0" encoding="UTF-8"?>'
    "<Error><Code>AccessDenied</Code><Message>Request has expired</Message></Error>"
)


def _graphql_id(kind: str, name: str) -> str:
    return base64.b64encode(f"{kind}:{name}".encode()).decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
