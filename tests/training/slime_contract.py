"""slime's ``Sample`` field contract for tests that run without slime: the testbed's stand-in."""

from shopsimrl.training.slime_step import ContractSample, installed

__all__ = ["ContractSample", "installed"]
