"""Tests that need a CUDA GPU. They are not collected in the normal suite (there is no GPU there, and a
skipped test would pretend to pass): LSE_RUN_CUDA=1 collects them, as benchmarks/cuda_check.sh does."""

import os

collect_ignore = [] if os.environ.get("LSE_RUN_CUDA") == "1" else ["test_cuda_device.py"]
