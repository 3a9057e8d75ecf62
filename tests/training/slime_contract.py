"""slime's ``Sample`` field contract for tests that run without slime: the testbed's stand-in."""

from shopsimrl.testbed.slime_round import ContractSample, installed

__all__ = ["ContractSample", "installed"]
