"""Research tools over finished runs: compare, report, view, export, gates, labels, judge.

They read runs through :mod:`shopsimrl.storage.reading` (a local run directory or a sharded run
location, traces of the earlier implementation included) and never write into a run. Nothing in
the core imports this package.
"""
