"""thomas_tune: autotuned kernels for on-device training of CNNs."""
