"""``python -m pretrain.bench``: the older name of ``python -m benchmarks.pretraining`` (step time,
images/s, augmentation throughput) and, as ``python -m pretrain.bench learning``, of
``python -m benchmarks.learning``. The benchmarks live in ``benchmarks/``, beside their results."""

from benchmarks.pretraining import main

if __name__ == "__main__":
    main()
