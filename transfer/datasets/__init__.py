"""Dataset generators and readers used by the transfer protocols."""
