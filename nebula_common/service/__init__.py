"""The one service skeleton: settings base, start with ordered cleanup, run until signalled, one ``main``.

Kept import-light on purpose: ``host.run_service_main`` installs its signal
handlers before the service's heavy modules (torch, gRPC) load, so a SIGTERM at
any moment of start-up ends the process cleanly.
"""
