#!/usr/bin/env bash
# The wheels benchmarks/gpu_evidence.sh carries to the GPU machine, in one step, from the project root:
#   bash benchmarks/gpu_wheels.sh
# the base set (optuna, SQLAlchemy, Alembic, datasets, ...) with bitsandbytes and liger-kernel (the
# 8-bit AdamW and QLoRA GPU tests, the Liger search), then a check that they, the working tree and the
# evidence's state stay under the 64 MiB a call may carry (exit 1, naming the sizes, if not). The
# image's pyarrow (25.0.1 on 2026-11-26) satisfies datasets 5 (>= 24); were it older, PYARROW=1
# carries pyarrow instead of the two extras (48 MB: they do not fit together). The wheels land in
# .whl/ (ignored by git), emptied first by ../shared/gpu/wheels.sh.
set -uo pipefail
root=$(git rev-parse --show-toplevel) || exit 1
cd "$root" || exit 1
extras=(bitsandbytes==0.50.2 liger-kernel)
[ "${PYARROW:-0}" = 1 ] && extras=(pyarrow)
../shared/gpu/wheels.sh "${extras[@]}" >/dev/null || exit 1
limit=$((64 * 1024 * 1024))
wheels=$(du -sb .whl | cut -f1)
tree=$( { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 -r du -cb 2>/dev/null | awk '$2 == "total" {s += $1} END {print s + 0}')
state=0
[ -d benchmarks/out/gpu-evidence ] && state=$(du -sb benchmarks/out/gpu-evidence | cut -f1)
total=$((wheels + tree + state))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "wheels $(mib "$wheels") + tree $(mib "$tree") + state $(mib "$state") = $(mib "$total") of $(mib "$limit")"
if [ "$total" -gt "$limit" ]; then
  echo "too much to carry: drop an extra, or leave the state behind" >&2
  exit 1
fi
ls -1 .whl
