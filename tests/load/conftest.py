from tests.server.conftest import make_server, server  # noqa: F401  (the real-server fixtures)
