"""ShopSimulator-compatible shop server (a system-level test double of the real environment).

Same HTTP contract as ShopSimulator ``shopsimulator-paper-aligned-v8``: lease pool, observation
state v7 and its Chinese rendering, action grammar and feedback, limits and the paper reward,
over a synthetic catalog in the real catalog record format.
"""

from shopsimrl.testbed.shop.server import ShopSettings, create_app, serve

__all__ = ["ShopSettings", "create_app", "serve"]
