"""The models the server serves, known to it only through fusedserve.model.api (the seam) and `load`.

Each architecture family is one file (bert.py, gte.py, ...) composing the blocks of layers.py on fusedserve.kernels'
ops, listed in families.py; packing.py holds the packed batch, attention modes and pooling; runner.py's Embedder is a
model on a device, made of loading.py (reading it), kernel_path.py (the kernel selection), forwards.py (eager and CUDA
graph forwards), warmup.py (the start-up's batches) and describing.py; served.py puts an Embedder behind the seam.
"""

if __name__ != "fusedserve.model":  # the checkout's root on sys.path: an installed `model` is meant
    from fusedserve.shadowing import give_way

    give_way(__name__, __file__)
else:  # the package, as fusedserve.model (docs/decisions/0015)
    from fusedserve.model.api import LoadOptions, ServedModel, TextSpec


    def load(path: str, options: LoadOptions) -> ServedModel:
        """The model at `path` ("default": the packaged all-MiniLM-L6-v2; a preset name: random weights; a checkpoint
        directory), ready for warm_up. Raises UnsupportedModel or CheckpointError (ValueErrors naming what is wrong).
        Importing this package loads no torch and no kernels: they load with the first model."""
        from fusedserve.model.served import load_served

        return load_served(path, options)


    def text_side(spec: TextSpec):
        """The preparation of inputs a loaded model describes (Description.text): prepare and decode as the model's own,
        in a process that loads neither torch nor the weights (a front-end of an engine)."""
        from fusedserve.model.tokenizer import TextPreparation

        return TextPreparation.of(spec)


    __all__ = ["load", "text_side"]
