"""Text generation from a trained or imported model: KV-cache decoding on the mesh (decode.py)."""
