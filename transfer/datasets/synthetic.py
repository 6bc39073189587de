"""``python -m transfer.datasets.synthetic``: the older name of ``python -m contrastive_transfer.synthetic``
(the generator moved to the base package: pretraining, the tests and the demo use it, not only transfer)."""

from contrastive_transfer.synthetic.generate import main

if __name__ == "__main__":
    main()
