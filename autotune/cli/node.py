"""`autotune node`: the ranks of the other nodes of a run on several machines (autotune/probe/node.py)."""

from __future__ import annotations

import click

from autotune.vocabulary import defaults
from autotune.cli.app import cli
from autotune.flags.arguments import check_cpu_ranks
from autotune.flags.values import COUNT, DEVICE, DURATION, INDEX, RENDEZVOUS


@cli.command()
@click.option(
    "--rendezvous",
    type=RENDEZVOUS,
    required=True,
    metavar="HOST:PORT",
    help="The first node's --rendezvous: where every node's ranks meet (torchrun's static rendezvous, "
    "hosted by the first node).",
)
@click.option("--nodes", type=COUNT, required=True, help="Nodes of the run, the first one included (as its --nodes).")
@click.option(
    "--node-rank", type=INDEX, required=True, help="This node's place among them: 1 to nodes-1 (the first node is 0)."
)
@click.option(
    "--gpus", type=COUNT, default=1, show_default=True, help="Ranks on this node (as the first node's --gpus)."
)
@click.option(
    "--device",
    type=DEVICE,
    default="auto",
    show_default=True,
    help="auto, cuda or cpu: what this node's ranks probe on.",
)
@click.option("--rounds", type=COUNT, default=None, help="Stop after this many probes [default: until stopped].")
@click.option(
    "--rendezvous-timeout",
    type=DURATION,
    default=f"{defaults.RENDEZVOUS_SECONDS:g}s",
    show_default=True,
    help="How long each wait for the first node's next probe lasts before it starts again; a wait that "
    "another program at --rendezvous holds is stopped soon after, with a line saying so.",
)
def node(rendezvous, nodes, node_rank, gpus, device, rounds, rendezvous_timeout):
    """Take part in the probes of a search on several nodes: start this node's ranks for each probe the
    first node runs (`autotune search ... --nodes N --rendezvous HOST:PORT` there), until stopped."""
    from autotune.vocabulary.errors import BadInput
    from autotune.probe.node import serve_node
    from autotune.probe.settings import ProbeSettings
    from autotune.levers.sharding import count_problems

    settings = ProbeSettings(device=device, rendezvous=rendezvous)  # (checks both forms)
    problems = []
    if nodes < 2:
        problems.append(f"--nodes must be at least 2 for a node to join (got {nodes})")
    elif not 1 <= node_rank < nodes:
        problems.append(
            f"--node-rank must be from 1 to {nodes - 1} (got {node_rank}; the first node, 0, runs the search)"
        )
    problems += count_problems(gpus, nodes)  # (the run's ranks, as search counts them; --rounds: a COUNT)
    if problems:
        raise BadInput("; ".join(problems) + ".")
    check_cpu_ranks(gpus, device)  # (as search and probe: each CPU rank computes on this machine's cores)
    click.echo(
        f"node {node_rank} of {nodes}: {gpus} rank{'s' if gpus != 1 else ''} on {settings.device_kind}, meeting "
        f"at {rendezvous}; waiting for the first node's probes (Ctrl-C stops)",
        err=True,
    )
    serve_node(
        rendezvous,
        nodes,
        node_rank,
        gpus,
        settings.device_kind,
        lambda line: click.echo(line),
        rounds,
        rendezvous_timeout=rendezvous_timeout,
        warn=lambda line: click.echo(line, err=True),
    )
