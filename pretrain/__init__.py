"""Contrastive self-supervised pretraining of ResNets on Accelerate (MoCo, SimCLR, EqCo, SiMo, ...)."""
