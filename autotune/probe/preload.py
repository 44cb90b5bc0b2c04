"""What the probe children's fork server imports once (autotune.host.processes.fork_server_context), so
that each child forked from it starts with torch and transformers already imported. First the
server's tie to its parent, its deafness to a terminal's Ctrl-C, and OpenMP's wait policy, which
torch reads when it loads (autotune.host.processes.quiet_openmp)."""

import gc
import signal

from autotune.host.processes import (
    collector_paused,
    fork_server_ready,
    quiet_openmp,
    tie_fork_server_to_owner,
)

tie_fork_server_to_owner()  # (its children die with it in turn)
# A Ctrl-C at the terminal reaches the whole group, the server too: it is for the command, which
# says it in one line, not for the server to print a KeyboardInterrupt from its imports (it dies
# with the command). Its children take Python's handler back (run_as_child).
signal.signal(signal.SIGINT, signal.SIG_IGN)
quiet_openmp()

try:
    with collector_paused():
        import torch  # noqa: F401
        import transformers
        import transformers.modeling_utils  # noqa: F401  (its imports are most of a model class's)

    # The imports made ~10^6 long-lived objects: frozen here, once, a child forked from this server
    # skips them in its own collections (the probe child's first gc.collect took 0.24 s of CPU per
    # child, measured, and 0.00 s after this) and does not copy their pages by touching them.
    gc.collect()
    gc.freeze()
finally:
    fork_server_ready()  # (what the parent waits for, by its clock, before it asks for a child)
