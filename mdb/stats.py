"""The old name of :mod:`mdb.hot` (hot-data patterns), kept so that code written for mdb 0.1 imports.

Importing it warns once (``DeprecationWarning``) and gives the same objects as ``mdb.hot``;
only the package's public names are here, not its submodules (``mdb.stats.counters`` is gone).
"""

import warnings

from mdb.hot import *  # noqa: F403 (the whole public API, by design)
from mdb.hot import __all__ as __all__

warnings.warn("mdb.stats is now mdb.hot; import from mdb.hot", DeprecationWarning, stacklevel=2)
