#!/usr/bin/env bash
# Device check for the tree attention kernel on an NVIDIA GPU (an H200 in this project):
#   1. the kernel tests compiled for the GPU (not interpret mode),
#   2. the kernel against XLA and jax.nn.dot_product_attention on verify-shaped problems,
#   3. the end-to-end benchmark, when scripts/bench.py exists.
# Results go to $OUT (or ./out) as bench_kernel.json. Takes a few minutes on an H200.
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-out}"
mkdir -p "$out_dir"

# eagle3jax.kernels is a package-dir mapping (pyproject.toml): install the checkout if needed.
if ! python3 -c "import eagle3jax.kernels" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-build-isolation -e .
fi
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"

echo "=== 1/3 kernel tests on the GPU ==="
python3 -m pytest -x -q tests/test_tree_attention.py -k GPU

echo "=== 2/3 kernel vs XLA vs dot_product_attention ==="
python3 scripts/bench_kernel.py --out "$out_dir/bench_kernel.json"

echo "=== 3/3 end-to-end benchmark ==="
if [ -f scripts/bench.py ]; then
  python3 scripts/bench.py --device gpu
else
  echo "scripts/bench.py not present; skipped"
fi
