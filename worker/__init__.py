"""The memsvc worker: the native allocator API, offload engine, model and gRPC servicer.

Importing this package does not load torch or the native extension; its submodules do.
"""
