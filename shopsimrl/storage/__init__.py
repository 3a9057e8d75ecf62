"""Run stores: where a run's manifest, traces and summary live, and how they are read.

A local directory is a one-shard store (:mod:`~shopsimrl.storage.local`: ``traces.jsonl``);
an object-store prefix or a directory with ``shards.json`` is an N-shard store
(:mod:`~shopsimrl.storage.sharded`: write-once parts and commit markers, on any fsspec URL through
:mod:`~shopsimrl.storage.objectstore`). :mod:`~shopsimrl.storage.reading` reads any run, either
kind, with the winner rule every reader shares. Nothing here runs episodes; the runner
(:mod:`shopsimrl.runner`) writes through these stores and the research tools read through them.
"""
