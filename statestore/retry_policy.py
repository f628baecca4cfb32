"""The one retry policy of statestore's clients (Redis, PostgreSQL, the model backend), in numbers.

A request is sent once more, at once, on a fresh connection, only when it failed on a pooled connection that turned
out closed (the server restarted, or closed it while idle) and sending it again cannot do a thing twice:

- the backend client (upstream/http1.py): a method without side effects (GET, HEAD, PUT, DELETE, OPTIONS) with no
  byte of its response read; a POST is never sent twice;
- Redis (store/resp.py, a follower's blocking read too, and each node's client on a Cluster): any command after a
  connection error, as every write statestore sends is a script that checks before it writes, so a repeat is
  harmless;
- PostgreSQL: no statement is sent twice; a pooled connection found closed is dropped before it is lent
  (store/pg_pool.py), and a commit whose acknowledgement was lost is settled by the turn, which asks whether it was
  stored.

Nothing else is retried: a timeout never (the server is slow or gone, and waiting twice doubles what a turn pays), and
there is no back-off between attempts (the retry goes to a new connection, not to the same failure). A Redis Cluster's
answers that name where to send a command instead (MOVED, ASK: store/resp_cluster.py) are followed, not retried, up to
CLUSTER_REDIRECTIONS times; TRYAGAIN (a multi-key command while its slot migrates) alone is sent again after a pause.

A Redis that keeps failing is then skipped for a while (RedisBreaker, store/resp.py): the cache serves from
the database, so an unreachable or black-holed Redis costs a process one timeout per back-off period, not one per
operation. On a Cluster each node has its breaker, so one failing master is skipped while the others serve.
"""

from __future__ import annotations

# Attempts after the first, on a fresh connection, when a pooled one turned out closed.
STALE_CONNECTION_RETRIES = 1

# Redis that failed (a timeout, a refused or lost connection) is skipped for this long, doubled at each failure in a
# row up to the maximum; the first call after the pause probes it, and a success ends the pause.
REDIS_BACKOFF_S = 1.0
REDIS_BACKOFF_MAX_S = 10.0

# Redirections a Cluster command follows before its last reply is returned as it is, and the pause before a command
# answered TRYAGAIN is sent again.
CLUSTER_REDIRECTIONS = 5
CLUSTER_TRY_AGAIN_S = 0.05
