"""`autotune serve`: the service. Pipelines submit searches over HTTP, queue workers on the GPU
machines run them (`autotune worker --queue`), and a page shows them live; one database (the
commands' own) is the truth for all of them.

Where things live: `commands.py` (a request body read as a command's flags, from the same table the
command line is made of: autotune/flags/table.py), `submissions.py` (a submitted search checked as `autotune search` checks it, and
what a client may name), `views.py` (what is said about a search: API and page), `plans.py` (the plans
being worked out: `POST /v1/plan`'s jobs), `auth.py`
(tokens), `app.py` (the FastAPI application: limits, errors, routes), `routes/` (one module per
resource: searches, answers, predictions, pages), `server.py` (`autotune serve`: uvicorn, the local worker), `templates/` (the pages, Jinja2 with
autoescaping), `static/` (the page's style and script,
shipped in the package: no CDN).

Importing this package loads nothing heavy: FastAPI and uvicorn are imported by app.py and server.py
only (the `service` extra), so a queue worker on a GPU machine needs neither (it lives below, in
autotune/search/queue_worker.py: `autotune worker --queue`).
"""
