"""Models: llama.py (Llama 3.1 family, linen) and sharding.py (mesh, logical axis rules, sharded init)."""

__all__: list[str] = []  # the submodules are the API
