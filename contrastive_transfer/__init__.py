"""What the three towers (pretrain → converters → transfer) share and nothing else: how a command
line fails and the errors it reports (``cli``, ``errors``), how an output directory is claimed and a
file written atomically, the checkpoint contract with the ResNet archs and stems (``contract``),
safe loading of untrusted files (``safe_load``), input limits and the synthetic datasets.

It imports none of the towers (tests/test_architecture.py checks it), so the converters and the
evaluators can import it without pulling in the pretraining engine. It is not standard library only:
``safe_load`` needs torch and numpy, ``images`` Pillow and ``yaml_limits`` PyYAML, while ``contract``
imports torch inside the functions that need it, so that a command's ``--help`` does not wait for it.
"""
