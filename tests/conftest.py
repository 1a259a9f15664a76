import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("SHARDLIB_TEST_TIMEOUT", "120")
