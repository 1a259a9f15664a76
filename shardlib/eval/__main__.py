"""``python -m shardlib.eval --config FILE --ckpt PATH``: see :mod:`shardlib.eval`."""

import sys

from . import entry

if __name__ == "__main__":
    sys.exit(entry())
