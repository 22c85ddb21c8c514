"""Process bootstrap, process groups and communication.

The only mpar package that imports ``torch.distributed``.
"""

from mpar.comm._grid import ProcessGrid
from mpar.comm._lifecycle import Session, State, init, is_initialized, session, shutdown, state
from mpar.comm._process_layout import Layout, detect_layout, expand_slurm_nodelist, free_port

__all__ = [
    "Layout",
    "ProcessGrid",
    "Session",
    "State",
    "detect_layout",
    "expand_slurm_nodelist",
    "free_port",
    "init",
    "is_initialized",
    "session",
    "shutdown",
    "state",
]
