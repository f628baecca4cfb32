"""statestore speaks to Redis through its own client only (store/resp.py, store/resp_cluster.py): redis-py is a test
dependency, never imported by the server, whichever Redis set-up it is given."""

from __future__ import annotations

import subprocess
import sys

_IMPORTS = """
import sys
import statestore.app, statestore.cli, statestore.resources
from statestore.store.event_log import create_event_log
from statestore.store.cache_setup import create_cache
create_cache("redis://127.0.0.1:1/0?cluster=1", "p:")
create_event_log("redis://127.0.0.1:1/0", "p:", cap=10)
print(sorted(name for name in sys.modules if name == "redis" or name.startswith("redis.")))
"""


def test_the_server_never_imports_redis_py() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"
