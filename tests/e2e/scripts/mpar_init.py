"""Initialise mpar from the launcher's environment and print the grid."""

import mpar

mpar.init({"pipeline_parallel_degree": 2})
print(f"rank={mpar.rank()} pp_size={mpar.pp_size()} dp_size={mpar.dp_size()}", flush=True)
mpar.shutdown()
