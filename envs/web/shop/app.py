"""The shop as a web app (FastAPI, plain HTML forms), served on the loopback by `ShopServer`.

Pages, every one under a session prefix so that concurrent episodes share one server:
    /{session}/                          the search box
    /{session}/search?q=...&page=N       10 results per page, best first (BM25 over titles and features)
    /{session}/item/{product}?q=&page=   the product: price, features, its options as radio buttons, Buy Now
    /{session}/buy/{product}?color=...   places the order (recorded for the env), thanks page

    server = ShopServer(catalog)   # starts uvicorn in a thread on a free loopback port
    server.url("abc")              # http://127.0.0.1:PORT/abc/
    server.orders["abc"]           # (product, chosen options) once bought
"""

from __future__ import annotations

import html
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from agentrl.envs.search.bm25 import BM25Index
from agentrl.envs.web.shop.catalog import Product
from agentrl.system.tcp import listening_socket

PAGE_SIZE = 10


def _page(title: str, body: str) -> HTMLResponse:
    return HTMLResponse(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                        "<style>body{font-family:sans-serif;max-width:860px;margin:1em auto}li{margin:.4em 0}"
                        "</style></head><body>" + body + "</body></html>")


def build_app(products: list[Product], orders: dict[str, tuple[Product, dict[str, str]]]) -> FastAPI:
    """The shop's FastAPI app over `products`; each session's first order goes into `orders`."""
    by_id = {p.id: p for p in products}
    index = BM25Index.build([{"id": p.id, "contents": p.text()} for p in products])
    app = FastAPI(title="agentrl shop", docs_url=None, redoc_url=None, openapi_url=None)
    esc = html.escape

    @app.get("/{session}/", response_class=HTMLResponse)
    def home(session: str):
        return _page("Shop", f"<h1>Shop</h1><form action='/{esc(session)}/search' method='get'>"
                             "<input type='text' name='q' aria-label='Search products' size='50'> "
                             "<button type='submit'>Search</button></form>")

    @app.get("/{session}/search", response_class=HTMLResponse)
    def search(session: str, q: str = "", page: int = 1):
        hits = index.search([q], k=len(products))[0] if q.strip() else []
        hits = [h for h in hits if h.score > 0]
        pages = max(1, -(-len(hits) // PAGE_SIZE))
        page = min(max(page, 1), pages)
        rows = "".join(
            f"<li><a href='/{esc(session)}/item/{p.id}?q={esc(q)}&page={page}'>{esc(p.title)}</a> ${p.price:.2f}</li>"
            for p in (by_id[h.id] for h in hits[(page - 1) * PAGE_SIZE:page * PAGE_SIZE]))
        nav = f"<a href='/{esc(session)}/'>Back to Search</a>"
        if page > 1:
            nav += f" <a href='/{esc(session)}/search?q={esc(q)}&page={page - 1}'>&lt; Prev</a>"
        if page < pages:
            nav += f" <a href='/{esc(session)}/search?q={esc(q)}&page={page + 1}'>Next &gt;</a>"
        found = f"Page {page} of {pages} ({len(hits)} results for \"{esc(q)}\")" if hits else \
            f"No results for \"{esc(q)}\"."
        return _page("Search results", f"<p>{nav}</p><p>{found}</p><ul>{rows}</ul>")

    @app.get("/{session}/item/{product_id}", response_class=HTMLResponse)
    def item(session: str, product_id: str, q: str = "", page: int = 1):
        p = by_id.get(product_id)
        if p is None:
            return _page("Not found", f"<p>No product {esc(product_id)}. "
                                      f"<a href='/{esc(session)}/'>Back to Search</a></p>")
        options = "".join(
            f"<fieldset><legend>{esc(name)}</legend>" + " ".join(
                f"<label><input type='radio' name='{esc(name)}' value='{esc(v)}'>{esc(v)}</label>" for v in values)
            + "</fieldset>" for name, values in p.options.items())
        return _page(p.title, f"<p><a href='/{esc(session)}/search?q={esc(q)}&page={page}'>&lt; Back to results</a></p>"
                              f"<h2>{esc(p.title)}</h2><p>Price: ${p.price:.2f}</p>"
                              f"<p>Features: {esc(', '.join(p.attributes))}</p>"
                              f"<form action='/{esc(session)}/buy/{p.id}' method='get'>{options}"
                              "<button type='submit'>Buy Now</button></form>")

    @app.get("/{session}/buy/{product_id}", response_class=HTMLResponse)
    def buy(session: str, product_id: str, request: Request):
        p = by_id.get(product_id)
        if p is None:
            return _page("Not found", f"<p>No product {esc(product_id)}.</p>")
        chosen = {k: v for k, v in request.query_params.items() if k in p.options}
        orders.setdefault(session, (p, chosen))  # the first order of a session is the one that counts
        picked = ", ".join(f"{k}: {v}" for k, v in chosen.items()) or "no options chosen"
        return _page("Thank you", f"<h2>Thank you for your order</h2><p>{esc(p.title)} ({esc(picked)}), "
                                  f"${p.price:.2f}</p>")

    return app


class ShopServer:
    """The shop app on 127.0.0.1 in a uvicorn thread of this process."""

    def __init__(self, products: list[Product], port: int = 0):
        self.orders: dict[str, tuple[Product, dict[str, str]]] = {}
        sock = listening_socket(port=port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(products, self.orders), log_level="warning", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="agentrl-shop", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the shop server did not start")
            time.sleep(0.02)

    def url(self, session: str) -> str:
        """The shop's home page for `session` (an episode's own prefix)."""
        return f"http://127.0.0.1:{self.port}/{session}/"

    def close(self) -> None:
        """Stop the server and wait (up to 10 s) for its thread."""
        self._server.should_exit = True
        self._thread.join(10)
