"""``python -m amp_plugin.compare <multirun dir>``: a table and a plot across runs.

See :mod:`amp_plugin.app.compare`.
"""

import sys

from amp_plugin.app.compare import collect_runs, format_table, main

__all__ = ["collect_runs", "format_table", "main"]

if __name__ == "__main__":
    sys.exit(main())
