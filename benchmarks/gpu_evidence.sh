#!/usr/bin/env bash
# benchmarks/gpu_evidence/ on the GPU machine, from the repository root (docs/gpu-evidence.md):
#   bash benchmarks/gpu_wheels.sh       # here: the wheels, their size with the tree's checked under 64 MiB
#   run(carry=[".whl"], timeout_s=570, command="bash benchmarks/gpu_evidence.sh --pass 1")
#   run(carry=[".whl", "benchmarks/out/gpu-evidence"], command="bash benchmarks/gpu_evidence.sh --pass 2")
# The first command line is ../shared/gpu/preamble.sh's, unchanged: it installs the carried wheels,
# links the migrations and checks the imports. $OUT is emptied before every call, so the state lives
# in the repository's ignored benchmarks/out/ (kept between calls only while the machine stays warm);
# the script also packs it into $OUT/gpu-evidence-state.tar.gz, which gives it back to a fresh machine.
# What comes back: gpu-evidence.json, gpu-evidence.log, gpu-evidence-state.tar.gz (and
# cuda_constants.json once that section ran): 3-4 of the 8 files $OUT may return.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; [ -e autotune/store/migrations ] || ln -s ../../migrations autotune/store/migrations; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1; python3 -c "import optuna, sqlalchemy, alembic, datasets, autotune.store.migrations, torch, transformers; print('ok:', torch.__version__, transformers.__version__, torch.cuda.get_device_name())" || exit 1;
python3 -m benchmarks.gpu_evidence --out "${OUT:?OUT names the folder that comes back}" --state "${STATE:-benchmarks/out/gpu-evidence}" --deadline "${DEADLINE:-520}" "$@"
