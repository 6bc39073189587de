"""What the three towers (pretrain → converters → transfer) share and nothing else: how a command
line fails, how an output directory is claimed, how a file is written atomically.

It depends on the standard library only, so the converters and the evaluators can import it without
pulling in the pretraining engine.
"""
