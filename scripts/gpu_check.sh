#!/usr/bin/env bash
# Device check for the tree attention kernel on an NVIDIA GPU (an H200 in this project):
#   1. the kernel tests compiled for the GPU (not interpret mode),
#   2. the kernel against XLA and jax.nn.dot_product_attention on verify-shaped problems,
#   3. the end-to-end benchmark, when scripts/bench.py exists,
#   4. plan.py for models one H200 holds (Llama-3.1-8B and Qwen3-8B with their EAGLE-3 drafters,
#      mesh 1,1), so that its memory and roofline figures can be set beside a real run.
# Results go to $OUT (or ./out) as bench_kernel.json and plan_*.json. Takes a few minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-out}"
mkdir -p "$out_dir"

# eagle3jax.kernels is a package-dir mapping (pyproject.toml): install the checkout if needed.
if ! python3 -c "import eagle3jax.kernels" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e .
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

echo "=== 1/4 kernel tests on the GPU ==="
python3 -m pytest -x -q tests/test_tree_attention.py -k GPU

echo "=== 2/4 kernel vs XLA vs dot_product_attention ==="
python3 scripts/bench_kernel.py --out "$out_dir/bench_kernel.json"

echo "=== 3/4 end-to-end benchmark ==="
if [ -f scripts/bench.py ]; then
  python3 scripts/bench.py --device gpu
else
  echo "scripts/bench.py not present; skipped"
fi

echo "=== 4/4 plan.py for models one H200 holds ==="
python3 scripts/plan.py --config configs/llama-3.1-8b-instruct.json \
  --drafter-config configs/llama-3.1-8b-eagle3.json --mesh 1,1 --batch 1 --context 8192 \
  --json > "$out_dir/plan_llama-3.1-8b.json"
python3 scripts/plan.py --config configs/qwen3-8b.json --drafter-config configs/qwen3-8b-eagle3.json \
  --mesh 1,1 --batch 1 --context 8192 --json > "$out_dir/plan_qwen3-8b.json"
