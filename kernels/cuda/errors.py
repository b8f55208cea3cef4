"""The CUDA backend's one exception, in a module of its own: build.py is also the command `python -m
fusedserve.kernels.cuda.build`, so the package must not import it (runpy would execute that file a second time as
__main__), and build.py must not import the package's __init__ for it (an import cycle)."""


class BuildUnavailable(RuntimeError):
    """The extension cannot be built or loaded here; the message says why."""
