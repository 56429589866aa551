"""The memsvc worker: the native allocator API, offload engine, model and gRPC servicer.

Public for embedding: :mod:`worker.allocator` (docs/python-api.md). The rest is the service's own
code. Importing this package does not load torch or the native extension; its submodules do.
"""
