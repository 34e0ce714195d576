"""Kernels for pdserve: Triton kernels with a plain-torch reference of the same signature.

The engine picks one implementation per device in ``engine/attention.py``; on CPU it runs the
references in ``kernels/ref_*.py``. Importing this package imports neither torch nor triton.
"""
