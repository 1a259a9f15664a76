import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDLIB_TEST_TIMEOUT", "120")
# debug mode of the collective trace: ranks compare kind, shape and dtype before each collective
# (shardlib.mesh.trace), so a test whose ranks diverge fails with the mismatch named, not a native abort
os.environ.setdefault("SHARDLIB_CHECK_COLLECTIVES", "1")
