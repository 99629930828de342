"""Every rank loads its own tuning table; rank 1's differs, or rank 1 has none
(MCRDL_TUNING_RANK1=none); or, with MCRDL_FUSION_RANK1 set, no rank has a table and rank 1
passes that fusion_bytes. init() must fail on every rank."""

import os
import sys

import mcrdl

rank1 = os.environ.get("MCRDL_TUNING_RANK1", "other")
path = os.environ.get("MCRDL_TUNING_BASE")
fusion = None
if int(os.environ["PMI_RANK"]) == 1:
    if "MCRDL_FUSION_RANK1" in os.environ:
        fusion = int(os.environ["MCRDL_FUSION_RANK1"])
    else:
        path = None if rank1 == "none" else path + ".other"
try:
    mcrdl.init(tuning=path, fusion_bytes=fusion)
except mcrdl.MCRDLError as exc:
    print(f"refused rank={os.environ['PMI_RANK']}: {exc}", flush=True)
    sys.exit(0)
print("accepted", flush=True)
sys.exit(1)
