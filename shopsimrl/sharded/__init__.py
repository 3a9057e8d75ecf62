"""Sharded runs: N shard workers write write-once trace parts to an object store, a reducer merges them.

- :mod:`~shopsimrl.sharded.objectstore`  local directory or S3 through fsspec: create-only writes, retries
- :mod:`~shopsimrl.sharded.layout`       the run layout: manifest, shard map, parts, commit markers, progress
- :mod:`~shopsimrl.sharded.worker`       ``shopsimrl worker``: one shard, from resume to its commit marker
- :mod:`~shopsimrl.sharded.reduce`       ``shopsimrl reduce``: committed shards → ``summary.json``
- :mod:`~shopsimrl.sharded.status`       ``shopsimrl status``: progress per shard, without reading parts
- :mod:`~shopsimrl.sharded.local_job`    ``run --shards N``: an Indexed Job emulated by local processes
- :mod:`~shopsimrl.sharded.kube`         the Kubernetes client (the ``kube`` extra): Job and pod reports
"""
