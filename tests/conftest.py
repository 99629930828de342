import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# tests/multirank/ runs only inside the ranks that tests/test_multirank.py launches.
collect_ignore_glob = [] if os.environ.get("MCRDL_MULTIRANK") else ["multirank/*"]
