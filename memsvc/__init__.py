"""memsvc: put idle LLM model workers to sleep and wake them fast.

This package (manager, CLI, client helpers, generated stubs under ``memsvc.v1``) imports neither
torch nor the native extension; the worker and its allocator live in the ``worker`` package.
"""

__version__ = "0.1.0"
