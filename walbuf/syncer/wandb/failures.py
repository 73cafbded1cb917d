"""wandb's failures, sorted by whether a retry can fix them.

- UploadError ("retry later"): the server unreachable or timing out, a 5xx,
  a 429 that outlasted the retries;
- ConfigError: what will fail the same way every time: missing or refused
  credentials, a setting wandb refuses (a malformed WANDB_BASE_URL, a bad
  run id), any other 4xx (a deleted run's id, no permission, no such
  entity);
- RowRefused (walbuf.syncer.wandb.run): wandb refused one row's data; the
  syncer quarantines that record and goes on.

Anything else wandb raises is a bug, here or in wandb, and is not caught.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ...errors import ConfigError, TargetRefusedError, UploadError, WalbufError

REINSTALL = "reinstall wandb for this machine (pip install --force-reinstall wandb); a retry gets the same"


def settings_problem(exc: ValueError) -> str:
    """What pydantic's ValidationError of wandb's Settings says of each setting (its first line names none)."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return describe(exc)
    try:
        found = errors(include_url=False)
    except TypeError:
        return describe(exc)
    parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', '')}" for e in found]
    return "; ".join(parts) or describe(exc)


LOGIN = "run `wandb login` or set WANDB_API_KEY (and WANDB_BASE_URL for a private server)"


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
        return ConfigError(f"W&B refused {doing} (HTTP 401): {detail}; {LOGIN}")
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
        return ConfigError(f"W&B refused {doing} ({answer}): {words}; {LOGIN}")
    advice = "check the project and entity (walbuf status shows them) and that your W&B user may write there"
    return TargetRefusedError(f"W&B refused {doing} ({answer}): {words}; {advice}")


def init_log(directory: Path) -> str:
    """The ERROR lines wandb-core logged for an init that failed, under ``directory`` ("" if none)."""
    lines = []
    for path in sorted(directory.glob("wandb/*/logs/debug-internal.log")):
        if path.is_symlink():
            continue
        with path.open(encoding="utf-8", errors="replace") as log:
            lines += [line for line in log if '"level":"ERROR' in line]
    return "".join(lines)


_TASK_NAME = re.compile(r"\bName: ([^,]+),")  # wandb-core's DefaultUploadTask, as it logs one


def upload_failure(run: Any) -> tuple[str | None, list[str]]:
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


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
