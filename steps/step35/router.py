"""The router in front of a prefill engine and a decode engine (python steps/step35/router.py --prefill URL --decode URL):
OpenAI's API to the client, two engines behind it. A completion or chat request goes first to the prefill engine
(a kv_producer), as the client sent it but for max_tokens 1, no stream and kv_transfer_params {"do_remote_decode":
true}: it runs the prompt, samples the first token and lends its blocks; its answer's kv_transfer_params go with the
client's request, unchanged otherwise, to the decode engine (a kv_consumer), which pulls the blocks and decodes from
the first token, streamed or not as the client asked; the router relays that answer, byte for byte. An error from
either engine reaches the client as that engine gave it (OpenAI's shape, its status); an engine that cannot be reached
is a 502. The router's key (--api-key, or LLM_STEPS_API_KEY) guards every path but /health, as the engines' does;
the engines behind it are reached without a key (they listen where only the router reaches them). /health is 200
while both engines answer theirs."""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import argparse
import contextlib
import os
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .serve import API_KEY_ENV, APIError, RequireKey, Server, parse_body, streaming


class RouterState:
    """What the key check reads (serve.py's Server.check_key)."""

    check_key = Server.check_key

    def __init__(self, api_key: str | None):
        self.api_key = api_key


def prefill_body(body: dict, chat: bool) -> dict:
    """The client's request as the prefill engine gets it: one token, whole (no stream), its blocks lent."""
    first = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    first["max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"] = 1
    first["kv_transfer_params"] = {"do_remote_decode": True}
    return first


class Router:
    """The two engines behind the router, and how a request goes to them."""

    def __init__(self, prefill: str, decode: str):
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10))

    async def health(self):
        for url in (self.prefill, self.decode):
            try:
                if (await self.client.get(f"{url}/health", timeout=5)).status_code != 200:
                    raise APIError(503, f"the engine at {url} is not healthy", kind="server_error")
            except httpx.HTTPError:
                raise APIError(503, f"the engine at {url} does not answer", kind="server_error") from None
        return JSONResponse({"status": "ok"})

    async def models(self):
        r = await self.client.get(f"{self.decode}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    async def route(self, request: Request, path: str, chat: bool):
        """The prefill engine first (one token, its blocks lent), then the decode engine with its answer's
        kv_transfer_params; the decode engine's answer relayed, streamed or not."""
        body, _ = parse_body(await request.body())
        streamed, _ = streaming(body)
        first = await self.client.post(f"{self.prefill}{path}", json=prefill_body(body, chat))
        if first.status_code != 200:  # the prefill engine's error, as it gave it
            return Response(first.content, status_code=first.status_code, media_type="application/json")
        transfer = first.json().get("kv_transfer_params")
        if transfer is None:
            raise APIError(502, f"the engine at {self.prefill} answered without kv_transfer_params: is it a "
                                "kv_producer?", kind="server_error")
        second = {**body, "kv_transfer_params": transfer}
        if not streamed:
            r = await self.client.post(f"{self.decode}{path}", json=second)
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        upstream = await self.client.send(self.client.build_request("POST", f"{self.decode}{path}", json=second),
                                          stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, status_code=upstream.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # the client went away, or the stream ended: the decode engine's request ends with it
                await upstream.aclose()
        return StreamingResponse(relay(), media_type="text/event-stream")


def build_router(prefill: str, decode: str, api_key: str | None = None) -> FastAPI:
    router = Router(prefill, decode)

    @asynccontextmanager
    async def lifespan(app):
        yield
        await router.client.aclose()

    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, title="llm-steps router", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        error = APIError(e.status_code, f"{e.detail} ({request.method} {request.url.path})")
        return JSONResponse(error.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(httpx.HTTPError)
    async def unreachable(request: Request, e: httpx.HTTPError):
        error = APIError(502, f"an engine behind the router could not be reached: {type(e).__name__}: {e}",
                         kind="server_error")
        return JSONResponse(error.body(), status_code=502)

    app.add_middleware(RequireKey, server=RouterState(api_key))
    app.add_api_route("/health", router.health, methods=["GET"])
    app.add_api_route("/v1/models", router.models, methods=["GET"])

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.route(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.route(request, "/v1/chat/completions", chat=True)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", required=True, help="the prefill engine (a kv_producer), as http://HOST:PORT")
    parser.add_argument("--decode", required=True, help="the decode engine (a kv_consumer), as http://HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on every path but "
                                                        f"/health (default: the environment variable {API_KEY_ENV})")
    args = parser.parse_args()
    if not 0 <= args.port < 65536:
        parser.error(f"argument --port: must be in 0..65535, got {args.port}")
    import uvicorn

    print(f"routing on http://{args.host}:{args.port}/v1: prefill {args.prefill}, decode {args.decode}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(build_router(args.prefill, args.decode, args.api_key or os.environ.get(API_KEY_ENV) or None),
                    host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
