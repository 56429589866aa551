"""The service runtime: what the manager, the gateway, the CLI and the worker share to run as gRPC
and HTTP services, one module per concern.

- :mod:`~memsvc.runtime.auth`: bearer token, TLS and mutual TLS, for servers and channels;
- :mod:`~memsvc.runtime.serving`: a grpc.aio server with health, reflection, the error mapping and an
  ordered graceful shutdown;
- :mod:`~memsvc.runtime.rpc_errors`: the one place where errors become gRPC statuses, and back;
- :mod:`~memsvc.runtime.deadline`: a caller's deadline, shared by calls that wait on one operation;
- :mod:`~memsvc.runtime.replay`: a repeated ``request_id`` gets the first call's result;
- :mod:`~memsvc.runtime.limits`: every bound on what a client can send or make a server keep;
- :mod:`~memsvc.runtime.logs`: stderr logging as text or JSON, and the stdout lines scripts wait for;
- :mod:`~memsvc.runtime.metrics`: what every Prometheus registry of ours shares;
- :mod:`~memsvc.runtime.swap_forms`: the forms a SwapBlocks request names its blocks in;
- :mod:`~memsvc.runtime.flags`: command-line settings, their ``MEMSVC_*`` variables and value types;
- :mod:`~memsvc.runtime.bytecode`: compiled modules kept between starts where the installation keeps none.
- :mod:`~memsvc.runtime.service_flags`: the flags every service command shares (auth, logging, byte-code).

Who imports it: ``memsvc.manager``, ``memsvc.gateway``, ``memsvc.cli`` and ``memsvc up``, the client
SDK (``memsvc.client``, and ``memsvc`` re-exports :class:`~memsvc.runtime.auth.Security`,
``error_info`` and ``retry_delay``), and ``worker``. It imports none of them: only ``memsvc.errors``,
``memsvc.vocabulary``, the stubs and third-party libraries, so every service can build on it
(tests/test_package_layers.py). It is
not a public API for other programs (docs/python-api.md): use the names ``memsvc`` exports.
"""
