"""Structured output: grammars that constrain which token may come next.

``spec`` (what a request asks for) and ``compile`` (turning it into an llguidance grammar,
with bounded work) are torch-free, so the router validates with the same code the engine
runs; ``matcher`` follows one request's output and ``masks`` turns a batch's matchers into a
device bitmask, which the samplers apply (``kernels.bitmask``, ``kernels.triton_sample``).
"""
