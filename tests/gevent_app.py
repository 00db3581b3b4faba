"""The example app plus one route that blocks the gevent hub on purpose, so the gevent test
can show that its detector (gevent's monitor thread) sees a blocked hub when there is one."""

from __future__ import annotations

from example_app import create_app

app = create_app()


@app.get("/block-the-hub")
def block_the_hub() -> str:
    from gevent import monkey

    monkey.get_original("time", "sleep")(0.8)
    return "blocked"
