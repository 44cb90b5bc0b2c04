"""What the probe children's fork server imports once (autotune.processes.fork_server_context), so
that each child forked from it starts with torch and transformers already imported. First the
server's tie to its parent, and OpenMP's wait policy, which torch reads when it loads
(autotune.processes.quiet_openmp)."""

from autotune.processes import kill_me_with_parent, quiet_openmp

kill_me_with_parent()  # (the server's parent: the search; its children die with the server in turn)
quiet_openmp()

import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
import transformers.modeling_utils  # noqa: E402,F401  (its imports are most of a model class's)
