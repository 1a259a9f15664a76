"""``python -m shardlib.train --config FILE``: see :mod:`shardlib.train`."""

import sys

from . import entry

if __name__ == "__main__":
    sys.exit(entry())
