"""What per-rank output routing costs a rank that writes a lot: ``python benchmarks/output_cost.py [REPEATS]``.

One rank prints 100 MB in 100-byte lines, routing off then on (``prefix_output=True``), with this process's
fd 1 on /dev/null so that the routing is measured, not the console: the ``output`` cell of ``run.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cells import output  # noqa: E402
from benchmarks.common import median  # noqa: E402

if __name__ == "__main__":
    for name in ("off", "on"):
        result = output(name == "on", int(sys.argv[1]) if sys.argv[1:] else 3)
        write, launch = median(result["write"]), median(result["launch"])
        print(f"routing {name}: the rank wrote in {write:.2f} s, the launch took {launch:.2f} s")
