"""The memsvc worker: the native allocator API, offload engine, model and gRPC servicer.

Public for embedding: :mod:`worker.allocator` (docs/python-api.md). The rest is the service's own
code. Importing this package does not load torch or the native extension; its submodules do.

It builds on the shared layer alone (``memsvc.errors``, ``memsvc.vocabulary``, ``memsvc.runtime``,
the stubs), never on the manager or the gateway, which it reaches over gRPC. Of ``memsvc``, only the
command line imports it: ``memsvc.cli`` through :mod:`worker.command`, and ``memsvc up`` the native
layer's GPU count (tests/test_package_layers.py).
"""
