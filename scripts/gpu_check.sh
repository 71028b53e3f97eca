#!/usr/bin/env bash
# The checks that need a GPU, in one run (about 5 minutes on one H200): the CUDA tests, then the
# codec's stages and the whole DeMo exchange step timed on the GPU. CI has no GPU and never runs this.
#
#   bash scripts/gpu_check.sh [OUT]        # OUT: folder for the logs and results (default gpu_check/)
#   DEMO_REFERENCE=/path/to/bloc97-DeMo/demo.py bash scripts/gpu_check.sh   # the reference side by side
#
# It uses the `python3` on the PATH as it is (a GPU machine's own PyTorch and Lightning; install the
# package's dependencies first where they are missing) with this checkout first on PYTHONPATH.
# Writes OUT/versions.txt, OUT/pytest_cuda.log, OUT/codec.{json,md}, OUT/exchange_step_cuda.{json,md},
# OUT/exchange_profile_d2048_l4_cuda.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

{
  nvidia-smi -L
  python3 -c 'import sys, torch, lightning, torch.distributed as d
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "lightning", lightning.__version__)
print("device", torch.cuda.get_device_name(0), "nccl", d.is_nccl_available() and ".".join(map(str, torch.cuda.nccl.version())))'
} 2>&1 | tee "$out/versions.txt"

echo "== CUDA tests"
python3 -m pytest tests/test_cuda.py -v -rs --durations=10 2>&1 | tee "$out/pytest_cuda.log" || status=1

echo "== codec stages on the GPU"
python3 benchmarks/codec.py --device cuda --min-run-time 0.2 --out "$out" 2>&1 | tail -40 || status=1

echo "== the whole exchange step on the GPU (201 M-parameter GPT shapes)"
python3 benchmarks/exchange_step.py --device cuda --d-model 2048 --out "$out" 2>&1 | tail -30 || status=1

echo "== where that step's GPU time goes (torch.profiler)"
python3 benchmarks/exchange_profile.py --device cuda --d-model 2048 --out "$out" 2>&1 | grep -v '^USDT\|^ERROR' | tail -40 || status=1

exit $status
