"""The `autotune` command group and its entry point: user mistakes become one line and exit 2.
The commands live beside this module, one per concept (measure, search, results, train); each
parses its flags, calls one library function, prints. No SQL, sessions, Optuna or torch in this
package: those live in the modules the commands call."""

from __future__ import annotations

import errno
import json
import signal
import sys
from typing import NoReturn

import click

from autotune.flags.flag import usage_message
from autotune.vocabulary.errors import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    EXIT_USER_ERROR,
    AutotuneError,
)
from autotune.host.output import silence_stdout, stdout_fault, stdout_reader_gone
from autotune.host.processes import Terminated, quiet_openmp
from autotune.vocabulary.version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="autotune")
def cli() -> None:
    """Find the fastest training configuration that fits your GPU, by measuring it."""


def stop_on_signals() -> None:
    """Ctrl-C (SIGINT), SIGTERM and SIGHUP (the terminal closed; unless started under nohup) stop
    every command at once, its children with it (they die with their parent: autotune.host.processes),
    whatever the shell left set: a job started in the background by a non-interactive shell inherits
    SIGINT ignored, and would otherwise run on. (`search` and `worker` install their own handlers
    while they search: the first Ctrl-C lets the probe in flight finish.)"""
    from autotune.host.processes import on_termination

    def terminate(signum, frame):
        raise Terminated

    signal.signal(signal.SIGINT, signal.default_int_handler)
    on_termination(terminate)


def main() -> None:
    """Entry point: user mistakes become one line on stderr and exit status 2; bugs keep tracebacks."""
    stop_on_signals()
    quiet_openmp()  # (before anything imports torch: train does, in this process)
    stdout_id = id(sys.stdout)  # (not the stream itself: stdout_fault looks for it in the traceback's frames)
    try:
        cli.main(standalone_mode=False)
        _flush(sys.stdout)  # what is still buffered fails here, where it is said, not at the interpreter's exit
    except SystemExit as exc:
        # click catches a broken pipe itself and exits 1 (swapping sys.stdout for a quiet wrapper):
        # that 1 would read as search's "nothing fits"; say it as a broken pipe instead.
        if exc.code == 1 and id(sys.stdout) != stdout_id and stdout_reader_gone():
            _exit_reader_gone()
        raise
    except OSError as exc:
        if not stdout_fault(exc):
            raise  # a bug: keep its traceback
        if exc.errno == errno.EPIPE:
            _exit_reader_gone()
        silence_stdout()
        click.echo(
            f"autotune: error: cannot write standard output: {exc.strerror} (errno {exc.errno}); "
            f"free space where it goes, or send it elsewhere.",
            err=True,
        )
        sys.exit(EXIT_USER_ERROR)
    except AutotuneError as exc:
        click.echo(f"autotune: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, Terminated):
            click.echo("autotune: terminated (SIGTERM); run the same command to resume", err=True)
            sys.exit(EXIT_TERMINATED)
        click.echo("autotune: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.UsageError as exc:
        click.echo(f"autotune: error: {usage_message(exc)}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except click.ClickException as exc:
        click.echo(f"autotune: error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)


def _flush(stream) -> None:
    stream.flush()


def _exit_reader_gone() -> NoReturn:
    """The reader of stdout went away (`autotune leaderboard | head -1`): stop quietly, with the
    status a shell gives a program that SIGPIPE ended (128 + 13), as `cat` or `grep` there would
    end, so that a pipeline (`set -o pipefail` included) treats autotune as it treats them; 1 is
    search's "nothing fits", 0 would claim the whole output was read."""
    silence_stdout()
    sys.exit(EXIT_BROKEN_PIPE)


def echo_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, default=str))
