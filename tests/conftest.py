import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDLIB_TEST_TIMEOUT", "120")
# debug mode of the collective trace: ranks compare kind, shape and dtype before each collective
# (shardlib.mesh.trace), so a test whose ranks diverge fails with the mismatch named, not a native abort
os.environ.setdefault("SHARDLIB_CHECK_COLLECTIVES", "1")
# ... comparing across ranks during each task's first optimizer step only: the fingerprint exchange before
# every collective was 28% of the workers' CPU on test_tensor_parallel.py (py-spy), and a test's later
# steps repeat its first step's collectives; the local checks (devices, contiguity) stay on every step
os.environ.setdefault("SHARDLIB_CHECK_STEPS", "1")

import importlib  # noqa: E402

launch = importlib.import_module("shardlib.mesh.launch")  # the module (shardlib.mesh.launch is also the function)

# imported once by the pool's fork server instead of by every worker: a worker imports the test
# module a function comes from, with everything it imports (pytest and hypothesis, ~1 s of CPU;
# transformers' models, ~2 s; the distributed checkpoint, ~1.3 s). Measured on test_hf_tp.py: 42 of
# the workers' 117 s of CPU were these imports. Not through the environment: the scripts, kernels
# and torchrun jobs the tests start need none of it
launch.EXTRA_PRELOAD[:] = [
    "pytest", "hypothesis", "torch.distributed.checkpoint", "shardlib.checkpoint", "shardlib.testing",
    "shardlib.train", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2",
]
