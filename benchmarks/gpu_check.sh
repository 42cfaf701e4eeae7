#!/usr/bin/env bash
# GPU check (one H200, <= 8 minutes): the kernel tests on CUDA, the decode-attention
# benchmark, decode through generate on a random-weight Llama-3-8B-shaped model (bf16,
# 8K tokens, eager and compiled: CUDA graphs where the graph allows them), and the peak
# memory of a chunked prefill of that model at 32K tokens (the DynamicCache's 32K and 128K
# rows are in benchmarks/results/gpu_peak_memory.json).
# Runs with the machine's own python3 (torch + triton + transformers, no network):
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# Writes OUT_DIR/gpu_tests.log, gpu_kernels.json, gpu_decode.json and gpu_peak_memory.json
# (default benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-benchmarks/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
# A machine without network: wheels carried in .whl/ (e.g. the transformers version the
# project is tested with) go first on the path.
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/hqekv-site .whl/*.whl
  export PYTHONPATH="/tmp/hqekv-site:$PYTHONPATH"
fi
python3 - <<'PY'
import torch, triton
assert torch.cuda.is_available(), "no CUDA device"
import transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      torch.cuda.get_device_name())
PY
# Kernel tests (Triton compiled for the GPU, compared with the CPU references) and the
# patched model's compiled decode on CUDA, over a static cache too.
status=0
# Spread over 8 workers where pytest-xdist is installed: most of the time is Triton and
# inductor compiling, which runs on the CPU.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || true)
timeout 120 python3 -m pytest -q -p no:cacheprovider $workers tests/kernels tests/test_compile.py tests/cache/test_static.py -k "not smollm2" 2>&1 \
  | tee "$out/gpu_tests.log" || status=1
timeout 60 python3 benchmarks/attention_kernels.py --out "$out/gpu_kernels.json" || status=1
timeout 150 python3 benchmarks/decode_random.py --shape llama3-8b --lengths 8192 --bavg 3.2 \
  --dtype bfloat16 --out "$out/gpu_decode.json" || status=1
# Peak memory of a chunked prefill plus decode tokens (torch.cuda.max_memory_allocated), the
# whole Llama-3-8B shape in bf16, DynamicCache against hqekv at bavg 2; rows saved as they come.
# Each case prints its progress (model loaded, warmed up, prefill seconds) as it goes.
timeout 150 python3 benchmarks/peak_memory.py --cases llama3-8b:32768 --chunks 2048 --bavg 2 \
  --dtype bfloat16 --new-tokens 16 --out "$out/gpu_peak_memory.json" || status=1
exit $status
