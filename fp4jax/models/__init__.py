"""Models: llama.py (Llama 3.1 family, linen) and sharding.py (mesh, logical axis rules, sharded init)."""
