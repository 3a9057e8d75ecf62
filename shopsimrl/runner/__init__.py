"""Running a frozen plan: scheduling episodes, their stores' writers, signals, and the commands
around a run.

- :mod:`~shopsimrl.runner.experiment`  config → the prepared run (jobs, prompt, skills, adapters, plan)
- :mod:`~shopsimrl.runner.scheduler`   ``Evaluator``: episodes in flight, retries of infrastructure failures
- :mod:`~shopsimrl.runner.local`       ``shopsimrl run``: one process, a local run directory
- :mod:`~shopsimrl.runner.worker`      ``shopsimrl worker``: one shard, from resume to its commit marker
- :mod:`~shopsimrl.runner.local_job`   ``run --shards N``: an Indexed Job emulated by local processes
- :mod:`~shopsimrl.runner.reduce`      ``shopsimrl reduce``: committed shards → ``summary.json``
- :mod:`~shopsimrl.runner.status`      ``shopsimrl status``: progress per shard, without reading parts
- :mod:`~shopsimrl.runner.lease_journal`  the ShopSimulator leases a process holds
- :mod:`~shopsimrl.runner.progress`    live progress bars and a local run's ``progress.json``
- :mod:`~shopsimrl.runner.kube`        the Kubernetes client (the ``kube`` extra): Job and pod reports
"""
