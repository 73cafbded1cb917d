"""The batched hand-over: the records a wandb run publishes, kept and handed to wandb's asyncio thread in one call."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any


class Batcher:
    """Keeps the records a wandb run publishes, and hands them to wandb's asyncio thread in one call.

    Relies on wandb's internals (a run's ``_interface``, an InterfaceSock
    with ``_publish``, ``_deliver``, ``_assign``, ``_asyncer`` and
    ``_client``), as they are in the wandb versions of TESTED_WANDB.
    """

    TESTED_WANDB = ("0.31.0",)

    def __init__(self, interface: Any, request_type: Any, records: Any, fill: Callable[[Any, Any], None]) -> None:
        self._interface = interface
        self._request_type = request_type
        self._records = records  # wandb's record messages (wandb_internal_pb2)
        self._fill = fill  # writes one value into a history item, as wandb's run.log would
        self._kept: list[Any] = []

    @classmethod
    def of(cls, run: Any) -> Batcher | None:
        """A batcher for ``run``'s records; None if this wandb is not one it was checked against."""
        import wandb

        if wandb.__version__ not in cls.TESTED_WANDB:
            return None
        from wandb.sdk.interface.interface_sock import InterfaceSock

        interface = getattr(run, "_interface", None)
        if type(interface) is not InterfaceSock:
            return None
        messages: Any = importlib.import_module("wandb.proto.wandb_server_pb2")  # generated: no types to check
        records: Any = importlib.import_module("wandb.proto.wandb_internal_pb2")
        return cls(interface, messages.ServerRequest, records, _filler(run))

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
        """A row of plain values (PLAIN), with its ``_timestamp`` and ``_runtime``, published as a whole history row.

        wandb's run.log passes each row through layers that change nothing
        in a row of numbers and strings (history_dict_to_json converts media
        and numpy values; a step or commit given; tensorboard) and publishes
        it as a partial row, which wandb-core's handler completes one by one:
        it writes the uploader's ``_runtime`` into it and emits a summary
        record per row (core stream/handler.go, flushPartialHistory). A
        HistoryRecord passes the handler untouched (handleRecord: a no-op for
        Record_History) and the sender numbers it (``_step``, as it numbers
        the handler's rows: historystep.go), as `wandb beta sync` hands its
        rows over; so the row carries its own ``_timestamp`` and ``_runtime``
        (the upload gives the job's), and the run's summary is the one the
        upload sends whole. Nothing W&B keeps is lost: wandb-core uploads no
        glob-expanded definitions (runupserter.go, UpdateMetrics) and each
        row holds its writer's step axis.
        """
        # Kept as InterfaceSock._publish would keep what _publish_history
        # makes of it (a Record holding only the row, its stream assigned),
        # built in place rather than copied twice.
        request = self._request_type()
        record = request.record_publish
        items = record.history.item
        for key, value in row.items():
            item = items.add()
            item.key = key
            self._fill(item, value)
        self._interface._assign(record)
        self._kept.append(request)
        run._local_step += 1  # as run.log without a step or commit

    def mark(self) -> Any:
        """Send a mark the sender answers in order with the rows before it; the handle of its answer.

        A StopStatus request: the handler forwards it (core
        stream/handler.go, handleRequestStopStatus), which reaches the sender
        in order (straight online, with no transaction log: stream.go; offline
        the flow control keeps it in its place: flowcontrolbuffer.go), and the
        sender answers whether the file stream stopped (sender.go,
        sendRequestStopStatus). In installed(), what is kept is handed over
        first, as for any request that waits for an answer.
        """
        record = self._records.Record(request=self._records.Request(stop_status=self._records.StopStatusRequest()))
        record.control.local = True  # as wandb's own requests: not written to the run's .wandb file
        return self._interface._deliver(record)

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


def _filler(run: Any) -> Callable[[Any, Any], None]:
    """How Batcher.log writes a plain value into a history item: as wandb's set_history_value does, in the forms
    the run's settings ask for.

    In the default form (JSON only), straight through pydantic-core as
    wandb's own encoder does it for a plain value (wandb/sdk/lib/json_util.py
    ``dumps``: ``to_json(..., inf_nan_mode="constants")``, its fallback never
    needed by a plain value; a text it refuses, a lone surrogate, goes to
    wandb's function, which has the standard library spell it). Building an
    encoder per value took most of a row's time in wandb's function.
    """
    from pydantic_core import PydanticSerializationError, to_json
    from wandb.sdk.interface.history_value import set_history_value
    from wandb.sdk.wandb_settings import HISTORY_VALUE_ENCODING_JSON, HISTORY_VALUE_ENCODING_TYPED

    forms = run._settings.x_history_value_encoding.split(",")
    json_form, typed_form = HISTORY_VALUE_ENCODING_JSON in forms, HISTORY_VALUE_ENCODING_TYPED in forms

    def as_wandb(item: Any, value: Any) -> None:
        set_history_value(item, value, json_form=json_form, typed_form=typed_form)

    if typed_form or not json_form:
        return as_wandb

    def as_json(item: Any, value: Any) -> None:
        try:
            item.value_json = to_json(value, inf_nan_mode="constants").decode()
        except PydanticSerializationError:
            as_wandb(item, value)

    return as_json


# The values of a row Batcher.log builds as run.log would: JSON's own, which
# wandb's history_dict_to_json passes through unchanged.
PLAIN = frozenset({int, float, bool, str, type(None)})
