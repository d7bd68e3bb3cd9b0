"""profstream: a live profiler for long training runs.

    from profstream import Monitor
    mon = Monitor(run_id="my-run")          # options: see profstream.config
    for batch in loader:
        with mon.step():
            ...
"""

from profstream.config import ConfigError
from profstream.producers.monitor import Monitor
from profstream.schema import COMMUNICATION, COMPUTE, DATA, HOST, MEMCPY, MEMSET

__all__ = ["COMMUNICATION", "COMPUTE", "DATA", "HOST", "MEMCPY", "MEMSET", "ConfigError", "Monitor"]
__version__ = "0.1.0"
