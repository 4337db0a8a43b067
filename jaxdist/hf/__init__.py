"""Hugging Face interop: config and tensor-name mapping (mapping.py), the families registry
(families.py), Hub ids (hub.py), safetensors onto the mesh (tensors.py), export (export.py)."""
