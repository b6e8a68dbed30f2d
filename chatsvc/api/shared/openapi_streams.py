"""The OpenAPI entry of a route that answers JSON, or server-sent events with ``stream: true``."""

from __future__ import annotations

from dataclasses import dataclass

from litestar.openapi.spec import OpenAPIMediaType, OpenAPIResponse, Operation, Schema
from litestar.openapi.spec.enums import OpenAPIType


@dataclass
class StreamingOperation(Operation):
    """Documents ``text/event-stream`` beside the JSON body of the 200 answer.

    Litestar documents one media type per response; a streamed answer would otherwise
    be undocumented, and clients or schema checkers that hold a server to its schema
    (schemathesis's content-type check) reject it.
    """

    def __post_init__(self) -> None:
        ok = (self.responses or {}).get("200")
        if isinstance(ok, OpenAPIResponse) and ok.content is not None:
            ok.content["text/event-stream"] = OpenAPIMediaType(schema=_EVENT)


# One event of the stream (the schema applies to each event, as OpenAPI 3.2's
# itemSchema does); ``data`` is the JSON text the route's description names.
_EVENT = Schema(
    type=OpenAPIType.OBJECT,
    required=["data"],
    properties={
        "event": Schema(type=OpenAPIType.STRING),
        "data": Schema(type=OpenAPIType.STRING),
        "id": Schema(type=OpenAPIType.STRING),
        "retry": Schema(type=OpenAPIType.INTEGER),
    },
    description="one server-sent event",
)
