"""The papers' diagnostics (EqCo Table 9, DCL Figure 1, AdCo Figure 2, training curves);
run ``python -m pretrain.analysis --help``."""
