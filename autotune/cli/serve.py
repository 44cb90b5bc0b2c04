"""`autotune serve` (the service) and `autotune token` (who may use it)."""

from __future__ import annotations

import click

from autotune.cli.app import cli, echo_json
from autotune.flags.flag import options
from autotune.flags.table import DB, DEVICE_HELP
from autotune.flags.values import DEVICE
from autotune.launchers import LAUNCHERS


@cli.command()
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to listen on; any but loopback needs a token to exist first (autotune token create).",
)
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="Port to listen on.")
@click.option(
    "--allowed-host",
    "allowed_host",
    multiple=True,
    metavar="NAME",
    help="A name clients reach the service by (repeatable), e.g. autotune.example.com: requests naming any "
    "other Host are refused [default: loopback names on loopback, the --host address otherwise].",
)
@options((DB,))
@click.option(
    "--local-worker",
    is_flag=True,
    help="Also run a queue worker on this machine (autotune worker --queue), which dies with the service.",
)
@click.option(
    "--worker-device", type=DEVICE, default="auto", show_default=True, help=f"The local worker's device: {DEVICE_HELP}"
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Start N queue workers with the service (stopped with it), where --launcher starts them.",
)
@click.option(
    "--launcher",
    type=click.Choice(LAUNCHERS),
    default="local",
    show_default=True,
    help="Where --workers start: local (this machine, one GPU each), ray (Ray tasks) or slurm (a job array).",
)
@click.option("--ray-address", default=None, metavar="HOST:PORT", help="The Ray cluster's head, for --launcher ray.")
@click.option("--slurm-partition", default=None, help="The partition of the workers' job array, for --launcher slurm.")
@click.option("--slurm-time", default=None, help="The job's time limit (e.g. 24:00:00), for --launcher slurm.")
@click.option("--slurm-option", multiple=True, help="One more sbatch option (repeatable), for --launcher slurm.")
@click.option(
    "--public-read", is_flag=True, help="Let anyone read (searches, events, answers, the page) without a token."
)
@click.option(
    "--model-root",
    default=None,
    metavar="DIR",
    help="Clients may name local models, data sets and tokenizers under this directory (by their path "
    "under it); otherwise only hub ids. Workers on other machines need it at the same path.",
)
@click.option(
    "--allow-remote-code", is_flag=True, help="Let requests ask for trust_remote_code (a model's own code runs)."
)
def serve(
    host,
    port,
    allowed_host,
    db,
    local_worker,
    worker_device,
    workers,
    launcher,
    ray_address,
    slurm_partition,
    slurm_time,
    slurm_option,
    public_read,
    model_root,
    allow_remote_code,
):
    """Serve searches over HTTP: pipelines submit, queue workers run them, a page shows them live."""
    from autotune.launchers.choose import make_launcher
    from autotune.service.server import serve as run

    chosen = make_launcher(
        launcher,
        workers=workers,
        ray_address=ray_address,
        slurm_partition=slurm_partition,
        slurm_time=slurm_time,
        slurm_options=slurm_option,
    )
    run(
        host=host,
        port=port,
        db=db,
        local_worker=local_worker,
        worker_device=worker_device,
        public_read=public_read,
        model_root=model_root,
        allow_remote_code=allow_remote_code,
        hosts=allowed_host,
        say=lambda line: click.echo(line, err=True),
        workers=workers,
        launcher=chosen,
    )


@cli.group()
def token():
    """Make, list and revoke the service's bearer tokens (only their hashes are stored)."""


@token.command("create")
@click.argument("name")
@options((DB,))
def token_create(name, db):
    """Make a token called NAME and print it: it is shown this once."""
    from autotune.store import open_store

    with open_store(db) as store:
        secret = store.tokens.create(name)
    click.echo(secret)
    click.echo(
        f"autotune: token {name!r} made; it is not shown again. Send it as `Authorization: Bearer TOKEN`.", err=True
    )


@token.command("revoke")
@click.argument("name")
@options((DB,))
def token_revoke(name, db):
    """Revoke the token called NAME: requests carrying it are refused from now on."""
    from autotune.store import open_store

    with open_store(db) as store:
        store.tokens.revoke(name)
    click.echo(f"revoked {name}")


@token.command("list")
@options((DB,))
@click.option("--json", "as_json", is_flag=True, help="One JSON list.")
def token_list(db, as_json):
    """The tokens' names and when they were made (never the tokens)."""
    from autotune.store import open_store

    with open_store(db, read_only=True) as store:
        rows = store.tokens.all()
    if as_json:
        echo_json([row.to_dict() for row in rows])
    else:
        for row in rows:
            click.echo(f"{row.name}\t{row.created_at.isoformat(timespec='seconds')}")
