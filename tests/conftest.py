"""Plugins of the whole suite: the tier rule (tests/tiers.py) and pytester, which
tests/test_tiers.py uses to run small sessions in this process."""

pytest_plugins = ["tests.tiers", "pytester"]
