"""The id of the request being served, visible to serving code through a contextvar."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from servprof.observers import RequestRecord

request_id_var: ContextVar[str | None] = ContextVar("servprof_request_id", default=None)
request_record_var: ContextVar[RequestRecord | None] = ContextVar("servprof_request_record", default=None)

# Request ids end up inside profiler event names ("servprof:decode_step|id1,id2"),
# so only a conservative alphabet is accepted from clients.
_SAFE_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def current_request_id() -> str | None:
    """The servprof request id of the request this code is serving, if any."""
    return request_id_var.get()


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def accept_request_id(candidate: str | None) -> str:
    """The client's id when it is safe to carry into traces, otherwise a fresh one."""
    if candidate and _SAFE_REQUEST_ID.match(candidate):
        return candidate
    return new_request_id()


def annotate_request(**attributes: Any) -> None:
    """Attach attributes (e.g. token counts) to the current request's record; a no-op
    outside a request served through ServprofMiddleware. Dotted OTel names can be
    passed with a dict: ``annotate_request(**{"gen_ai.usage.output_tokens": 40})``."""
    record = request_record_var.get()
    if record is not None:
        record.attributes.update(attributes)
