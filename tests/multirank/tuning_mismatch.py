"""Every rank loads its own tuning table; rank 1's differs. init() must fail on every rank."""

import os
import sys

import mcrdl

path = os.environ["MCRDL_TUNING_BASE"] + (".other" if int(os.environ["PMI_RANK"]) == 1 else "")
try:
    mcrdl.init(tuning=path)
except mcrdl.MCRDLError as exc:
    print(f"refused rank={os.environ['PMI_RANK']}: {exc}", flush=True)
    sys.exit(0)
print("accepted", flush=True)
sys.exit(1)
