"""`POST /abort_request` as SGLang has it: `{"rid": ..., "abort_all": false}` aborts the running /generate requests
that the client labelled with that rid, or with abort_all every one. A key reaches only the requests it sent
(a rid is only a client's label, and another tenant may use the same one); abort_all by an admin key reaches all."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from radixserve.server.auth import principal_of
from radixserve.server.protocol import AbortRequest
from radixserve.server.serving import abort_all, read_json, server_state


async def abort_request(request: Request) -> Response:
    state = server_state(request)
    req = await read_json(request, AbortRequest)
    who = principal_of(request)
    owner = None if req.abort_all and who.is_admin else who.name
    rids = state.live.find(owner, None if req.abort_all else req.rid)
    abort_all(state.engine, list(rids))
    return Response(status_code=200)
