"""`densa cluster`: the router and the worker pools as Ray actors (docs/cluster.md).

config       cluster.yaml -> ClusterConfig (no torch, no Ray: `densa cluster check` needs neither)
processes    SupervisedProcess: one densa process kept alive, restarted with backoff (no Ray)
actors       the Ray actor holding one SupervisedProcess on the node Ray placed it
supervisor   Cluster: placement group, actors, the router told every membership change
cli          `densa cluster up | check`

Ray is imported only by actors and supervisor; the serving processes themselves never see it.
"""
