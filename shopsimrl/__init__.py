"""shopsimrl — frozen, resumable rollouts of LLM shopping agents on ShopSimulator."""

__version__ = "0.5.0"
