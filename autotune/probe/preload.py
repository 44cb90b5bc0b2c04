"""What the probe children's fork server imports once (autotune.processes.fork_server_context), so
that each child forked from it starts with torch and transformers already imported. First the
server's tie to its parent, and OpenMP's wait policy, which torch reads when it loads
(autotune.processes.quiet_openmp)."""

from autotune.processes import quiet_openmp, tie_fork_server_to_owner

tie_fork_server_to_owner()  # (its children die with it in turn)
quiet_openmp()

import torch  # noqa: E402,F401
import transformers  # noqa: E402,F401
import transformers.modeling_utils  # noqa: E402,F401  (its imports are most of a model class's)
